"""`ds4-mlx serve`: the HTTP front end.

`app` (routes, auth, CORS, errors, streaming) over `worker` (the one thread that owns the Engine); `openai`,
`anthropic` and `responses` are pure translations between wire formats and the engine's events, sharing
`common` (normalized requests, field checks, ids, SSE framing) and `rawjson` (request bodies with the exact
bytes of each tool schema); `trace` records what the model saw and did.
"""
