"""Tools around the library (never imported by it): the benchmark (:mod:`.bench`), the planner CLI
(:mod:`.planner`) and the local multi-process launcher (:mod:`.launch`)."""
