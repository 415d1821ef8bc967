"""Audio: the loader (`loader`: the decoded samples charged from the header, then decoded) and the container
header and the decode to mono float32 PCM (`decode`)."""
