"""Budgeted FCFS encoder item scheduling, contiguous request buffers, encoder cache and input packing.

Pure library: torch and the standard library only.
"""

from encoder_scheduler.budget import EncoderBudget
from encoder_scheduler.buffers import RequestBuffer
from encoder_scheduler.cache import EncoderCache, EncoderCacheKey, processor_kwargs_key
from encoder_scheduler.errors import AdmissionError, MissingInputError, UnknownRequestError
from encoder_scheduler.items import EncoderItem, EncoderRequest
from encoder_scheduler.packing import (
    EncoderInputField,
    EncoderInputs,
    ItemRange,
    Qwen3VLBatch,
    RequestInputs,
    batch_encoder_inputs,
    batch_qwen3_vl_inputs,
)
from encoder_scheduler.plan import SchedulePlan
from encoder_scheduler.policy import SchedulingPolicy
from encoder_scheduler.progress import RequestProgress
from encoder_scheduler.scheduler import EncoderScheduler, SchedulerStats

__all__ = [
    "AdmissionError",
    "EncoderBudget",
    "EncoderCache",
    "EncoderCacheKey",
    "EncoderInputField",
    "EncoderInputs",
    "EncoderItem",
    "EncoderRequest",
    "EncoderScheduler",
    "ItemRange",
    "MissingInputError",
    "Qwen3VLBatch",
    "RequestBuffer",
    "RequestInputs",
    "RequestProgress",
    "SchedulePlan",
    "SchedulerStats",
    "SchedulingPolicy",
    "UnknownRequestError",
    "batch_encoder_inputs",
    "batch_qwen3_vl_inputs",
    "processor_kwargs_key",
]
