"""Building blocks every model family shares: the `Linear` layer and its quantization methods."""
