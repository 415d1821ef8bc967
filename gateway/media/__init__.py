"""A request's media: finding the items in the parsed body (`parts`, `body`), planning each item's route and what
the request keeps of it (`plan`), loading each with its modality's loader (`loader`, `base`; the packages `image`,
`video` and `audio`, with `container` for what video and audio share), where their bytes come from (`sources`:
inline data, fetch and SSRF), the media threads (`threads`), and what a request is charged (`accounting`,
`storage`)."""
