"""The schema of ``python -m hetpipe.doctor``: pretrain's config plus the doctor's own settings.

Its own module because every part of the doctor reads it (the fact sheet
reads the job config, the probes and the report read the timeouts) while the
entry point in hetpipe/doctor/cli.py uses all of those parts; kept there, the
schema would make each part import the entry point that imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.schema.pretrain_config import PretrainConfig, register_configs


@dataclass
class DoctorSettings:
    # Seconds to wait for every node's fact sheet and test results (nodes
    # start the doctor at different times), and for one probe's transfer.
    timeout_s: float = 120.0
    # Seconds a TCP connect to a peer's NIC may take before it counts as unreachable.
    connect_timeout_s: float = 5.0
    # Seconds of traffic per NIC pair for the bandwidth figure.
    bandwidth_s: float = 0.5

    def __post_init__(self) -> None:
        if min(self.timeout_s, self.connect_timeout_s, self.bandwidth_s) <= 0:
            raise ConfigError("doctor.timeout_s, connect_timeout_s and bandwidth_s must be positive")


@dataclass
class DoctorConfig(PretrainConfig):
    # Optional here: the NIC, version and data checks need no model; with
    # +model=NAME the whole job config is checked as pretrain checks it.
    model: Optional[ModelConfig] = None
    doctor: DoctorSettings = field(default_factory=DoctorSettings)

    def __post_init__(self) -> None:
        if self.model is not None:
            super().__post_init__()


def register_doctor_config() -> None:
    """Put the schema into hydra's ConfigStore (idempotent), next to pretrain's."""
    register_configs()
    ConfigStore.instance().store(name="doctor_schema", node=DoctorConfig)
