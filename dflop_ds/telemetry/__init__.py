"""Runtime telemetry of DeepSpeed pipeline training: per-instruction timers, per-step records
written through DeepSpeed's monitor, a log line, and ``dflop-ds report`` plots."""

from dflop_ds.telemetry.record import bubble_fraction, imbalance, log_line, monitor_events, observed_imbalance
from dflop_ds.telemetry.timers import PipelineTimer, StageTiming

__all__ = [
    "PipelineTimer",
    "StageTiming",
    "bubble_fraction",
    "imbalance",
    "log_line",
    "monitor_events",
    "observed_imbalance",
]
