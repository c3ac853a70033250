"""What a checkpoint saves and restores, as components that each give and take their state.

    state = training_state(named_params, model, optimizer, scheduler, scaler, data)
    ckpt = Checkpointer(cfg, layout, topo, state, tokenizer)        # llmtrain.checkpoint.manager

Two kinds of component:
- `ShardedTensors` (the trained parameters and the optimizer's accumulators): every rank
  writes its pieces of the full tensors into its shard (`llmtrain.checkpoint.shards`) and
  reads back the pieces its layout holds, whatever layout wrote them.
- manifest components (`Stateful`): small state kept in manifest.json. `state_dict()`
  returns the manifest entries the component owns; `load_state_dict(manifest)` takes the
  whole manifest (read after the resume contract accepted it) and restores from its entries.
  Here: the LR schedule (`ScheduleState`), the fp16 loss scaler (`ScalerState`) and the data
  position (`DataPosition`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


class Stateful(Protocol):
    """A manifest component."""

    def state_dict(self) -> dict:
        """{manifest key: JSON-able value} this component owns."""

    def load_state_dict(self, manifest: dict) -> None:
        """Restore from the entries of a checkpoint's manifest."""


def _jsonable(state: dict) -> dict:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in state.items()}


class ScheduleState:
    """The LR schedule: its Paddle state and the schedule in force (`optim.on_resume=checkpoint` may keep an older
    one than the config's). Restored by `resume_at(step)`: the LR of the next step is the schedule in force at that
    step, not the `last_lr` the writing run saved."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return {"scheduler": _jsonable(self.scheduler.state_dict()), "schedule_in_force": self.scheduler.in_force()}

    def load_state_dict(self, manifest: dict) -> None:
        self.scheduler.resume_at(manifest["step"])


class ScalerState:
    """fp16's dynamic loss scaler (None state without one)."""

    def __init__(self, scaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return {"scaler": _jsonable(self.scaler.state_dict()) or None if self.scaler is not None else None}

    def load_state_dict(self, manifest: dict) -> None:
        if self.scaler is not None and manifest.get("scaler"):
            self.scaler.load_state_dict(manifest["scaler"])


class DataPosition:
    """Where the data order stands (consumed samples, ramp-up)."""

    def __init__(self, data):
        self.data = data

    def state_dict(self) -> dict:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, manifest: dict) -> None:
        self.data.load_state_dict(manifest["data"])


@dataclass
class ShardedTensors:
    """The trained parameters and the optimizer holding their accumulators, saved as pieces of full tensors."""

    named_params: list
    """(canonical name, parameter) of this rank's trained parameters."""
    model: Any
    """The wrapped model (ZeRO-3 holds its parameters as flat slices found through it)."""
    optimizer: Any
    """The (wrapped) optimizer whose accumulators and master weights are saved beside the parameters."""


@dataclass
class TrainingState:
    """Everything a checkpoint holds for one rank."""

    tensors: ShardedTensors
    schedule: ScheduleState
    manifest_parts: list = field(default_factory=list)
    """The other `Stateful` components (scaler, data position)."""

    @property
    def components(self) -> list:
        """Every manifest component, the schedule first."""
        return [self.schedule, *self.manifest_parts]


def training_state(named_params, model, optimizer, scheduler, scaler: Optional[Any], data) -> TrainingState:
    """The components of a training run's checkpoint."""
    return TrainingState(ShardedTensors(named_params, model, optimizer), ScheduleState(scheduler),
                         [ScalerState(scaler), DataPosition(data)])
