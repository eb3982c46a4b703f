"""`asyncrl dashboard`: a read-only web dashboard of a run (docs/run.md "Dashboard").

    asyncrl dashboard --run-dir runs/tiny_demo            # http://127.0.0.1:8390

Modules, one concept each: `source` finds the run's Redis (live, or a replay of a finished run's data) and
folds its metrics stream with `asyncrl watch`'s RunView; `probes` asks the engines, the orchestrator and
the gateway how they are; `trajectories` pages, filters and opens the recorded samples; `access` is the
bearer token / login cookie; `app` is the HTTP app over them; `server` the command. The page itself is
plain HTML, CSS and JS under static/ (its charts are SVG drawn by static/charts.js): no build step, no CDN.
"""
