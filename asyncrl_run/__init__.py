"""The run layer (a name of its own: a user's driver.py or run/ in the working directory must not shadow it),
above every component: the Ray driver of a run (`python -m asyncrl_run.train`, the launcher,
`asyncrl eval`) and the programs around one (the `asyncrl` CLI, `asyncrl watch`, the dashboard, run metrics,
the summary, the W&B mirror). It may import the components; they import only `asyncrl`, never this package
(tests/test_structure.py)."""
