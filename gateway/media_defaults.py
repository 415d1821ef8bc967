"""What the media settings default to and may name, read both by the settings (gateway/config.py) and by the media
path (gateway/media/), and importing neither: the routes whose bodies an upstream reads media from, with the shape
of each body (the default `limits.admission_routes`), the containers and codecs `media.video_formats`,
`media.audio_formats` and their codec keys name, the frames a video's sampling takes and the rate audio is
resampled to."""

from __future__ import annotations

from enum import StrEnum


class BodyShape(StrEnum):
    """Where in a route's body the upstream reads media from (gateway/media/parts.py finds the items of each)."""

    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"
    POOLING = "pooling"
    COHERE_EMBED = "cohere_embed"
    SCORE = "score"
    URL_LISTS = "url_lists"
    GENERATE = "generate"
    INVOCATIONS = "invocations"


GENERATE_ROUTE = "/inference/v1/generate"

# Every route whose body vLLM 0.32.0 or trtllm-serve reads media from, and the shape of its body; the default
# `limits.admission_routes`. Each server's source file and version per route: docs/admission.md ("Routes that read
# media"). Not here: routes whose bodies carry no media (completions, detokenize, generative scoring) and multipart
# audio uploads (/v1/audio/transcriptions, /v1/audio/translations), which the gateway does not parse.
MEDIA_ROUTES: dict[str, BodyShape] = {
    # Chat messages: vLLM and trtllm-serve; the batch route takes a list of conversations.
    "/v1/chat/completions": BodyShape.CHAT,
    "/v1/chat/completions/batch": BodyShape.CHAT,
    "/v1/chat/completions/render": BodyShape.CHAT,
    "/tokenize": BodyShape.CHAT,
    # vLLM's Cohere chat (VLLM_ENABLE_COHERE_API): user content parts of `text` and `image_url`.
    "/cohere/v2/chat": BodyShape.CHAT,
    "/cohere/v2/chat/render": BodyShape.CHAT,
    "/v1/responses": BodyShape.RESPONSES,
    "/v1/responses/render": BodyShape.RESPONSES,
    "/v1/messages": BodyShape.MESSAGES,
    "/v1/messages/count_tokens": BodyShape.MESSAGES,
    "/v1/messages/render": BodyShape.MESSAGES,
    "/v1/embeddings": BodyShape.POOLING,
    "/pooling": BodyShape.POOLING,
    "/classify": BodyShape.POOLING,
    "/v2/embed": BodyShape.COHERE_EMBED,
    "/score": BodyShape.SCORE,
    "/v1/score": BodyShape.SCORE,
    "/rerank": BodyShape.SCORE,
    "/v1/rerank": BodyShape.SCORE,
    "/v2/rerank": BodyShape.SCORE,
    "/v1/systemone": BodyShape.URL_LISTS,
    GENERATE_ROUTE: BodyShape.GENERATE,
    "/invocations": BodyShape.INVOCATIONS,
}

# The names media.video_formats / media.audio_formats may list, and the FFmpeg demuxer that reads each. One
# demuxer reads several formats (mp4, mov and m4a; webm and mkv): a format is allowed when its demuxer is.
VIDEO_CONTAINERS = {
    "mp4": "mov,mp4,m4a,3gp,3g2,mj2",
    "mov": "mov,mp4,m4a,3gp,3g2,mj2",
    "webm": "matroska,webm",
    "mkv": "matroska,webm",
    "avi": "avi",
}
AUDIO_CONTAINERS = {
    "wav": "wav",
    "mp3": "mp3",
    "flac": "flac",
    "ogg": "ogg",
    "m4a": "mov,mp4,m4a,3gp,3g2,mj2",
    "webm": "matroska,webm",
}
DEFAULT_VIDEO_FORMATS = ("mp4", "mov", "webm", "mkv", "avi")
DEFAULT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a")
# Codec names as FFmpeg names the codec (not the decoder): "av1" whichever of libdav1d or the native decoder
# runs. A trailing `*` matches a family (`pcm_*`).
DEFAULT_VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
DEFAULT_AUDIO_CODECS = ("pcm_*", "mp3", "flac", "vorbis", "opus", "aac")

# vLLM's VideoMediaIO samples this many frames unless the deployment says otherwise.
VLLM_NUM_FRAMES = 32
# qwen-vl-utils' and transformers' Qwen video processors sample at most this many frames.
QWEN_MAX_FRAMES = 768

# The rate the model's feature extractor takes (Whisper, Qwen2-Audio: 16 kHz).
DEFAULT_SAMPLE_RATE = 16000
