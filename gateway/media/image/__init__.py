"""Images: the loader (`loader`: where an image is opened, charged and checked or decoded), reading the header and
decoding to RGB (`decode`), checking the structure at a fraction of a decode's cost (`check`), what the model
server's loader allocates for the file's metadata (`metadata`), and a JPEG's marker segments (`jpeg_markers`)."""
