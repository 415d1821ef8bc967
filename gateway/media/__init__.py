"""A request's media: finding the items in the parsed body (`parts`, `body`), loading each with its modality's
loader (`loader`, `base`; `image`, `video`, `audio` and their `*_decode` modules), where their bytes come from
(`inline`, `fetch` with `ssrf`), the media threads (`threads`), and what a request is charged (`accounting`,
`storage`)."""
