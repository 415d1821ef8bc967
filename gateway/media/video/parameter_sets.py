"""The frame size an H.264 or HEVC stream's parameter sets declare, read from the bitstream before any decoder sees it.

A container declares a frame size of its own (mp4's sample description, matroska's PixelWidth/PixelHeight), but
the decoder takes the size from the sequence parameter set (SPS), in the codec's extradata (avcC, hvcC) or in a
packet. A file whose container says 64x64 while its SPS says 12288x12288 makes FFmpeg allocate for the SPS: the
sizes here are read first, so the frame size a decoder will allocate is known, and charged or refused, before it
allocates. Only the fields up to the picture size are parsed (ITU-T H.264 7.3.2.1.1, H.265 7.3.2.2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CODECS", "FrameSize", "extradata_sizes", "packet_sizes"]

# FFmpeg's codec names whose parameter sets are read here.
CODECS = frozenset({"h264", "hevc"})

_H264_SPS = 7
_HEVC_SPS = 33
# H.264 profiles whose SPS carries chroma format, bit depths and scaling matrices (7.3.2.1.1).
_H264_HIGH_PROFILES = frozenset({100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135})
# No SPS field read here needs more: an exp-Golomb code longer than this is malformed.
_MAX_GOLOMB_ZEROS = 31


_CHROMA = {0: "gray", 1: "yuv420p", 2: "yuv422p", 3: "yuv444p"}  # by chroma_format_idc


@dataclass(frozen=True, slots=True)
class FrameSize:
    """A frame size an SPS declares: the coded size the decoder allocates, the displayed (cropped) size, the
    chroma format (`chroma_format_idc`) and the luma bit depth."""

    coded_width: int
    coded_height: int
    width: int
    height: int
    chroma_format: int = 1
    bit_depth: int = 8

    @property
    def coded_pixels(self) -> int:
        return self.coded_width * self.coded_height

    @property
    def pixel_format(self) -> str:
        """FFmpeg's name for the decoded frames' pixel format (`yuv420p`, `yuv420p10le`...)."""
        name = _CHROMA[self.chroma_format]
        return name if self.bit_depth == 8 else f"{name}{self.bit_depth}le"


class MalformedParameterSet(ValueError):
    """An SPS that ends early or holds values out of range."""


class _Bits:
    """An RBSP (a NAL unit's payload with its emulation-prevention bytes removed), read bit by bit."""

    def __init__(self, rbsp: bytes) -> None:
        self._value = int.from_bytes(rbsp, "big")
        self._left = len(rbsp) * 8

    def u(self, n: int) -> int:
        if n > self._left:
            raise MalformedParameterSet("the parameter set ends early")
        self._left -= n
        return (self._value >> self._left) & ((1 << n) - 1)

    def flag(self) -> bool:
        return bool(self.u(1))

    def ue(self) -> int:
        zeros = 0
        while not self.u(1):
            zeros += 1
            if zeros > _MAX_GOLOMB_ZEROS:
                raise MalformedParameterSet("an exp-Golomb code is too long")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        code = self.ue()
        return (code + 1) // 2 if code % 2 else -(code // 2)


def _rbsp(nal_payload: bytes) -> bytes:
    """The payload without the emulation-prevention bytes (00 00 03 -> 00 00)."""
    return nal_payload.replace(b"\x00\x00\x03", b"\x00\x00") if b"\x00\x00\x03" in nal_payload else nal_payload


def h264_sps_size(nal: bytes) -> FrameSize:
    """The frame size of an H.264 SPS NAL unit (its one-byte header included)."""
    bits = _Bits(_rbsp(nal[1:]))
    profile = bits.u(8)
    bits.u(16)  # constraint flags, level
    bits.ue()  # seq_parameter_set_id
    chroma_format = 1
    bit_depth = 8
    if profile in _H264_HIGH_PROFILES:
        chroma_format = bits.ue()
        if chroma_format > 3:
            raise MalformedParameterSet(f"chroma_format_idc {chroma_format}")
        if chroma_format == 3:
            bits.flag()  # separate_colour_plane_flag
        bit_depth = 8 + bits.ue()
        bits.ue()  # bit_depth_chroma_minus8
        bits.flag()  # qpprime_y_zero_transform_bypass_flag
        if bits.flag():  # seq_scaling_matrix_present_flag
            for index in range(8 if chroma_format != 3 else 12):
                if bits.flag():
                    _skip_scaling_list(bits, 16 if index < 6 else 64)
    bits.ue()  # log2_max_frame_num_minus4
    poc_type = bits.ue()
    if poc_type == 0:
        bits.ue()  # log2_max_pic_order_cnt_lsb_minus4
    elif poc_type == 1:
        bits.flag()
        bits.se()
        bits.se()
        cycle = bits.ue()
        if cycle > 255:
            raise MalformedParameterSet(f"num_ref_frames_in_pic_order_cnt_cycle {cycle}")
        for _ in range(cycle):
            bits.se()
    elif poc_type != 2:
        raise MalformedParameterSet(f"pic_order_cnt_type {poc_type}")
    bits.ue()  # max_num_ref_frames
    bits.flag()  # gaps_in_frame_num_value_allowed_flag
    width_mbs = bits.ue() + 1
    height_map_units = bits.ue() + 1
    frame_mbs_only = bits.flag()
    if not frame_mbs_only:
        bits.flag()  # mb_adaptive_frame_field_flag
    bits.flag()  # direct_8x8_inference_flag
    coded_width = width_mbs * 16
    coded_height = height_map_units * 16 * (1 if frame_mbs_only else 2)
    crop = (0, 0, 0, 0)
    if bits.flag():  # frame_cropping_flag
        crop = (bits.ue(), bits.ue(), bits.ue(), bits.ue())
    # Crop units (7-19, 7-20): chroma subsampling, and two rows a unit for field coding.
    unit_x = 2 if chroma_format in (1, 2) else 1
    unit_y = (2 if chroma_format == 1 else 1) * (1 if frame_mbs_only else 2)
    width = coded_width - unit_x * (crop[0] + crop[1])
    height = coded_height - unit_y * (crop[2] + crop[3])
    return FrameSize(coded_width, coded_height, max(width, 0), max(height, 0), chroma_format, bit_depth)


def _skip_scaling_list(bits: _Bits, size: int) -> None:
    last = next_scale = 8
    for _ in range(size):
        if next_scale:
            next_scale = (last + bits.se() + 256) % 256
        last = next_scale or last


def hevc_sps_size(nal: bytes) -> FrameSize:
    """The frame size of an HEVC SPS NAL unit (its two-byte header included)."""
    bits = _Bits(_rbsp(nal[2:]))
    bits.u(4)  # sps_video_parameter_set_id
    sub_layers = bits.u(3)  # sps_max_sub_layers_minus1
    bits.flag()  # sps_temporal_id_nesting_flag
    _skip_profile_tier_level(bits, sub_layers)
    bits.ue()  # sps_seq_parameter_set_id
    chroma_format = bits.ue()
    if chroma_format > 3:
        raise MalformedParameterSet(f"chroma_format_idc {chroma_format}")
    if chroma_format == 3:
        bits.flag()  # separate_colour_plane_flag
    coded_width = bits.ue()
    coded_height = bits.ue()
    crop = (0, 0, 0, 0)
    if bits.flag():  # conformance_window_flag
        crop = (bits.ue(), bits.ue(), bits.ue(), bits.ue())
    bit_depth = 8 + bits.ue()
    unit_x = 2 if chroma_format in (1, 2) else 1
    unit_y = 2 if chroma_format == 1 else 1
    width = coded_width - unit_x * (crop[0] + crop[1])
    height = coded_height - unit_y * (crop[2] + crop[3])
    return FrameSize(coded_width, coded_height, max(width, 0), max(height, 0), chroma_format, bit_depth)


def _skip_profile_tier_level(bits: _Bits, sub_layers: int) -> None:
    bits.u(88)  # general profile space, tier, profile, compatibility and constraint flags
    bits.u(8)  # general_level_idc
    present = [(bits.flag(), bits.flag()) for _ in range(sub_layers)]
    if sub_layers:
        bits.u(2 * (8 - sub_layers))  # reserved_zero_2bits
    for profile_present, level_present in present:
        if profile_present:
            bits.u(88)
        if level_present:
            bits.u(8)


def _sps(codec: str, nal: bytes) -> FrameSize | None:
    """The size of `nal` if it is an SPS of `codec`."""
    if codec == "h264" and nal and nal[0] & 0x1F == _H264_SPS:
        return h264_sps_size(nal)
    if codec == "hevc" and len(nal) > 1 and (nal[0] >> 1) & 0x3F == _HEVC_SPS:
        return hevc_sps_size(nal)
    return None


def _annex_b_units(data: bytes) -> Iterator[bytes]:
    """NAL units of an Annex B byte stream (split at 00 00 01 start codes)."""
    starts = []
    position = data.find(b"\x00\x00\x01")
    while position >= 0:
        starts.append(position + 3)
        position = data.find(b"\x00\x00\x01", position + 3)
    for index, start in enumerate(starts):
        end = starts[index + 1] - 3 if index + 1 < len(starts) else len(data)
        yield data[start:end].rstrip(b"\x00")  # a zero before the next start code belongs to it


def _length_prefixed_units(data: bytes, length_size: int) -> Iterator[bytes]:
    position = 0
    while position + length_size <= len(data):
        length = int.from_bytes(data[position : position + length_size], "big")
        position += length_size
        if length == 0 or position + length > len(data):
            return
        yield data[position : position + length]
        position += length


def nal_length_size(codec: str, extradata: bytes | None) -> int | None:
    """The size of the NAL length prefix in packets (from avcC / hvcC), or None for an Annex B stream."""
    if not extradata or extradata.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")):
        return None
    if codec == "h264" and len(extradata) >= 7 and extradata[0] == 1:
        return (extradata[4] & 0x03) + 1
    if codec == "hevc" and len(extradata) >= 23:
        return (extradata[21] & 0x03) + 1
    return None


def extradata_sizes(codec: str, extradata: bytes | None) -> list[FrameSize]:
    """The sizes of the SPSs in a stream's extradata: avcC or hvcC, or Annex B parameter sets."""
    if not extradata or codec not in CODECS:
        return []
    if nal_length_size(codec, extradata) is None:
        return [size for nal in _annex_b_units(extradata) if (size := _sps(codec, nal)) is not None]
    units: list[bytes] = []
    if codec == "h264":
        position, count = 6, extradata[5] & 0x1F
        for _ in range(count):
            length = int.from_bytes(extradata[position : position + 2], "big")
            units.append(extradata[position + 2 : position + 2 + length])
            position += 2 + length
    else:
        position, arrays = 23, extradata[22]
        for _ in range(arrays):
            if position + 3 > len(extradata):
                break
            count = int.from_bytes(extradata[position + 1 : position + 3], "big")
            position += 3
            for _ in range(count):
                length = int.from_bytes(extradata[position : position + 2], "big")
                units.append(extradata[position + 2 : position + 2 + length])
                position += 2 + length
    return [size for nal in units if (size := _sps(codec, nal)) is not None]


def packet_sizes(codec: str, packet: bytes, length_size: int | None) -> list[FrameSize]:
    """The sizes of the SPSs a packet carries (`length_size`: `nal_length_size`, None for Annex B)."""
    if codec not in CODECS:
        return []
    units = _annex_b_units(packet) if length_size is None else _length_prefixed_units(packet, length_size)
    return [size for nal in units if (size := _sps(codec, nal)) is not None]
