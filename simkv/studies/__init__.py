"""Studies built from simkv's general options (seed-article tables, allocator comparisons)."""
