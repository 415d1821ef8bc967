"""Videos: the loader (`loader`: the sampled frames charged from the header, then decoded, or resized into one clip
in engine mode), the container header, the frame sampling and the decode (`decode`), and the frame size an H.264
or HEVC stream's parameter sets declare (`parameter_sets`)."""
