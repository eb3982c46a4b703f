"""The run layer, above every component: the Ray driver of a run (`python -m driver.train`, the launcher,
`asyncrl eval`) and the programs around one (the `asyncrl` CLI, `asyncrl watch`, the dashboard, run metrics,
the summary, the W&B mirror). It may import the components; they import only `asyncrl`, never this package
(tests/test_structure.py)."""
