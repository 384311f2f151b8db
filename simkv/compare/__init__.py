"""Reports: one replay's report.html, and simulated-vs-measured comparisons (`simkv compare`)."""
