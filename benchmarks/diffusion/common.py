"""Shared helpers of the diffusion benchmarks: workload parsing, timing, tables, JSON and plots.

Used by every benchmark here. Pure Python except `sync` / `timed` (torch, imported lazily) and the
plots (matplotlib, imported lazily with the Agg backend, so the scripts run without matplotlib unless
`--plot` is given).

Workload grammar (one string on the command line)::

    size   WxH                       e.g. 1024x768 = width 1024, height 768 (multiples of 16)
    item   [N*]size                  e.g. 8*256x256 = eight 256x256 requests
    mix    item(+item)*              e.g. 512x512+256x256 ("," also separates items)
    mixes  mix(;mix)*                e.g. "512x512+512x512;8*256x256"
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SIZE_MULTIPLE = 16
"""Image sides must be multiples of this (VAE factor 8 x patch 2)."""

ISSUE5_MIXES = (
    "512x512+512x512;512x512+256x256;8*256x256;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512"
)
"""The default mixes: two same-shape pairs, 8 small requests, two sizes, the 4-size mix."""

DEFAULT_PROMPTS = (
    "A photo of a red fox sitting in fresh snow at dawn, soft light, shallow depth of field",
    "A lighthouse on a rocky coast at dusk",
    "An astronaut riding a horse on the surface of the moon, digital art, highly detailed, dramatic "
    "lighting, wide shot, the earth rising over the horizon, dust kicked up by the hooves",
    "A bowl of fresh fruit on a wooden kitchen table",
    "A watercolor painting of a quiet street in Kyoto in the rain, people with umbrellas",
    "A cute robot reading a book in a library",
    "A steaming cup of coffee next to an open notebook, morning sunlight through the window, cozy",
    "Mountains",
)
"""Prompts of different lengths, cycled over the requests of a mix (text length varies too)."""

DEFAULT_NEGATIVE_PROMPT = "blurry, low quality, distorted"
"""Negative prompt used for the CFG-on mode when `--negative-prompt` is not given."""


# ---- workload parsing ---------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class ImageSize:
    """One image resolution in pixels."""

    width: int
    height: int

    @property
    def label(self) -> str:
        """'WxH', as the OpenAI API's `size`."""
        return f"{self.width}x{self.height}"

    @property
    def num_img_tokens(self) -> int:
        """Packed image tokens: (H / 16) * (W / 16)."""
        return (self.height // SIZE_MULTIPLE) * (self.width // SIZE_MULTIPLE)

    @property
    def latent_grid(self) -> tuple[int, int, int]:
        """(frames, h, w) latent token grid."""
        return (1, self.height // SIZE_MULTIPLE, self.width // SIZE_MULTIPLE)


def parse_size(text: str, field_name: str = "size") -> ImageSize:
    """'WxH' -> ImageSize; ValueError naming `field_name` unless both sides are positive multiples of 16."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{field_name}: {text!r} is not WIDTHxHEIGHT (e.g. 1024x768)")
    width, height = (int(p) for p in parts)
    for name, side in (("width", width), ("height", height)):
        if side <= 0 or side % SIZE_MULTIPLE:
            raise ValueError(
                f"{field_name}: {name} of {text!r} must be a positive multiple of {SIZE_MULTIPLE}, got {side}"
            )
    return ImageSize(width, height)


@dataclass(frozen=True)
class Mix:
    """The requests of one benchmark case, in submission order."""

    sizes: tuple[ImageSize, ...]

    @property
    def name(self) -> str:
        """Canonical spelling: runs of equal sizes as N*WxH, joined by '+'."""
        items, i = [], 0
        while i < len(self.sizes):
            j = i
            while j < len(self.sizes) and self.sizes[j] == self.sizes[i]:
                j += 1
            items.append(self.sizes[i].label if j - i == 1 else f"{j - i}*{self.sizes[i].label}")
            i = j
        return "+".join(items)

    @property
    def num_img_tokens(self) -> int:
        return sum(s.num_img_tokens for s in self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def parse_mix(text: str, field_name: str = "mix") -> Mix:
    """'512x512+256x256', '8*256x256' or '1024x1024,512x512' -> Mix (see the module docstring)."""
    sizes: list[ImageSize] = []
    items = [item for item in text.replace(",", "+").split("+") if item.strip()]
    if not items:
        raise ValueError(f"{field_name}: {text!r} holds no image size")
    for item in items:
        count_text, _, size_text = item.rpartition("*")
        count = 1
        if count_text:
            if not count_text.strip().isdigit() or int(count_text) < 1:
                raise ValueError(f"{field_name}: repeat count in {item!r} must be a positive integer")
            count = int(count_text)
        sizes += [parse_size(size_text, field_name)] * count
    return Mix(tuple(sizes))


def parse_mixes(text: str, field_name: str = "--mixes") -> list[Mix]:
    """';'-separated mixes -> list of Mix; ValueError naming `field_name` when empty or malformed."""
    mixes = [parse_mix(part, field_name) for part in text.split(";") if part.strip()]
    if not mixes:
        raise ValueError(f"{field_name}: {text!r} holds no mix")
    return mixes


def parse_size_list(text: str, field_name: str = "--sizes") -> list[ImageSize]:
    """Comma-separated 'WxH' list (repeat counts allowed) -> sizes in order."""
    return list(parse_mix(text, field_name).sizes)


@dataclass(frozen=True)
class CfgMode:
    """Whether the requests of a case run true CFG (two sequences each), and with what."""

    enabled: bool
    true_cfg_scale: float
    negative_prompt: str | None
    """None when CFG is off (the engine runs CFG only with a negative prompt and scale > 1)."""

    @property
    def label(self) -> str:
        return "on" if self.enabled else "off"


def resolve_cfg_modes(
    cfg_modes: str | None, true_cfg_scale: float, negative_prompt: str | None
) -> list[CfgMode]:
    """The CFG modes to run.

    `cfg_modes` None: one mode, on exactly when `true_cfg_scale > 1` and a negative prompt is given
    (the engine's rule). Otherwise a comma list of 'off' / 'on'; 'on' uses `negative_prompt` (or
    `DEFAULT_NEGATIVE_PROMPT`) and needs `true_cfg_scale > 1`.
    """
    if cfg_modes is None:
        enabled = true_cfg_scale > 1.0 and negative_prompt is not None
        return [CfgMode(enabled, true_cfg_scale, negative_prompt if enabled else None)]
    modes = []
    for word in (w.strip().lower() for w in cfg_modes.split(",") if w.strip()):
        if word not in ("off", "on"):
            raise ValueError(f"--cfg-modes: entries must be 'off' or 'on', got {word!r}")
        if word == "on" and true_cfg_scale <= 1.0:
            raise ValueError(f"--cfg-modes on needs --true-cfg-scale > 1, got {true_cfg_scale}")
        negative = (negative_prompt or DEFAULT_NEGATIVE_PROMPT) if word == "on" else None
        modes.append(CfgMode(word == "on", true_cfg_scale, negative))
    if not modes:
        raise ValueError(f"--cfg-modes: {cfg_modes!r} holds no mode")
    return modes


def add_mix_args(parser: argparse.ArgumentParser, default_mixes: str = ISSUE5_MIXES) -> None:
    """--image-sizes, --mixes, --cfg-modes, --true-cfg-scale, --negative-prompt."""
    parser.add_argument(
        "--image-sizes",
        default=None,
        help="one mix as a comma list of WxH (e.g. 1024x1024,1024x768); runs before any --mixes",
    )
    parser.add_argument(
        "--mixes",
        default=None,
        help=f"';'-separated mixes of WxH items joined by '+' (default: {default_mixes!r})",
    )
    parser.add_argument(
        "--cfg-modes",
        default=None,
        help="'off', 'on' or 'off,on' (default: from --true-cfg-scale/--negative-prompt)",
    )
    parser.add_argument(
        "--true-cfg-scale", type=float, default=4.0, help="CFG scale when CFG is on (default 4.0)"
    )
    parser.add_argument(
        "--negative-prompt", default=None, help="negative prompt; CFG runs with it and scale > 1"
    )


def mixes_from_args(args: argparse.Namespace, default_mixes: str = ISSUE5_MIXES) -> list[Mix]:
    """Mixes from --image-sizes and --mixes (the default list when neither is given)."""
    mixes = [parse_mix(args.image_sizes, "--image-sizes")] if args.image_sizes else []
    if args.mixes or not mixes:
        mixes += parse_mixes(args.mixes or default_mixes)
    return mixes


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """--json-output, --plot, --no-progress."""
    parser.add_argument("--json-output", default=None, help="write the results as JSON to this path")
    parser.add_argument("--plot", default=None, help="write a PNG plot to this path (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bars")


def positive_int(name: str, value: int, minimum: int = 1) -> int:
    """Return `value`; ValueError naming the option unless `value >= minimum`."""
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# ---- timing -------------------------------------------------------------------------------------


def sync(device: Any) -> None:
    """Wait for queued work on `device` (CUDA); a no-op on CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any) -> tuple[Any, float]:
    """Run `fn()` between two device syncs; return (its result, wall seconds)."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def progress(total: int, desc: str, disable: bool = False):
    """A tqdm bar on stderr (stdout stays clean for the table)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


# ---- statistics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default 'linear' method); NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    return sum(values) / len(values) if values else math.nan


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is not positive."""
    if num is None or den is None or not den > 0 or math.isnan(num):
        return None
    return num / den


# ---- output -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One table column: row key, header and format spec (e.g. '.2f')."""

    key: str
    header: str
    fmt: str = ""


def format_cell(value: Any, fmt: str = "") -> str:
    """Format one cell; None / NaN print as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, fmt) if fmt else str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table with right-aligned numbers, for stdout."""
    cells = [[format_cell(row.get(c.key), c.fmt) for c in columns] for row in rows]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    sep = "  "
    lines = [sep.join(c.header.rjust(w) for c, w in zip(columns, widths))]
    lines.append(sep.join("-" * w for w in widths))
    lines += [sep.join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def environment_info(device: Any = None) -> dict[str, Any]:
    """Where and when a benchmark ran: host, Python, torch, GPU name, argv, UTC time."""
    info: dict[str, Any] = {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "argv": list(sys.argv),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if device is not None and torch.device(device).type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(torch.device(device))
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def _json_default(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _finite(value: Any) -> Any:
    """NaN / inf -> None recursively (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write `payload` as indented strict JSON (NaN -> null), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, default=_json_default, allow_nan=False) + "\n")
    return path


def get_pyplot():
    """matplotlib.pyplot with the Agg backend; ValueError naming --plot when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class BarPanel:
    """One subplot of grouped bars: one group per category, one bar per series."""

    title: str
    categories: list[str]
    series: dict[str, list[float | None]]
    """label -> one value per category (None = missing bar)."""
    ylabel: str
    hlines: dict[str, float] = field(default_factory=dict)
    """label -> y of a dashed reference line (e.g. speedup 1.0, a target, the GEMM ceiling)."""


def plot_bar_panels(path: str | Path, panels: Sequence[BarPanel], suptitle: str = "") -> Path:
    """Write grouped bar charts (one row of subplots) to a PNG."""
    plt = get_pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width = max(6.0, max(len(p.categories) for p in panels) * 1.6)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 4.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        num_series = max(1, len(panel.series))
        bar_width = 0.8 / num_series
        for k, (label, values) in enumerate(panel.series.items()):
            xs = [i + (k - (num_series - 1) / 2) * bar_width for i in range(len(panel.categories))]
            ys = [math.nan if v is None else v for v in values]
            bars = ax.bar(xs, ys, bar_width, label=label)
            for bar, y in zip(bars, ys):
                if not math.isnan(y):
                    ax.annotate(
                        f"{y:.3g}",
                        (bar.get_x() + bar.get_width() / 2, y),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        for k, (label, y) in enumerate(panel.hlines.items()):
            ax.axhline(y, linestyle="--", linewidth=1, color=f"C{num_series + k}", label=label)
        ax.set_xticks(range(len(panel.categories)))
        ax.set_xticklabels(panel.categories, rotation=15, ha="right", fontsize=8)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def event_median_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median CUDA-event milliseconds of `fn()` (each call between its own pair of events)."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke runs: host clock
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
