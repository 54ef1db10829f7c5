"""`kvlab serve`: an OpenAI-compatible server on the paged engine, Prometheus metrics, and the page.

    app.py         the app factory: routes, errors, body limit, the page
    openai_api.py  /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)
    schemas.py     OpenAI request / response models, validated at the edge
    errors.py      OpenAI-style JSON errors for every 4xx
    chat.py        chat templates (the checkpoint's Jinja2, or a plain default)
    bridge.py      the engine's own thread <-> asyncio: add, stream, abort, snapshot
    metrics.py     /metrics: engine gauges at scrape time, latency histograms
    page_api.py    /api/*: the page's views (planner, crossover, step-through, live cache)
    views.py       what those views compute, from kvlab.plan and kvlab.generate
    run.py         the command's flags, loading the model, uvicorn

Nothing is imported here, so building the CLI parser stays light.
"""
