"""What the gateway shares with the engine process, without torch: the submit format (`wire`), the client
(`engine_client`), the model geometry (`geometry`), and the plumbing both servers are built on (`asgi`,
`headers`, `serving`, `settings_loader`, `settings_types`). The gateway imports nothing else of `engine_adapter`.
"""
