"""Step caching per sequence inside the packed forward (cache-dit's DBCache, TeaCache); docs/caching.md.

`config.py` holds the settings (pure Python); `dbcache.py` / `teacache.py` each backend's decision
for one branch; `step.py` runs one packed forward's blocks with every sequence's decision;
`state.py` builds a request's branches."""
