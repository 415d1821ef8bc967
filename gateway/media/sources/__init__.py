"""Where an item's bytes come from: inline data (`inline`: data URLs and bare base64, read without a decoded copy),
and http(s) URLs (`fetch`, guarded by `ssrf`)."""
