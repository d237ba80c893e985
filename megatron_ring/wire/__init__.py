"""Wire codecs: how a K/V block is packed into the one buffer that travels (as is, BF16, scaled FP8)."""
