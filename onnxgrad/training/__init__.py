"""Training with a step graph (`onnxgrad train`): the step graph (step.py), its data (data.py), the executor
that runs a step (executor.py), the loop around it (trainer.py), checkpoints (checkpoint.py), progress
(progress.py) and the trained forward model (export.py)."""
from .checkpoint import read_checkpoint
from .data import Batches
from .executor import SessionExecutor, StepExecutor
from .step import StepGraph, read_step_graph
from .trainer import StepGraphTrainer, TrainResult

__all__ = ["Batches", "SessionExecutor", "StepExecutor", "StepGraph", "StepGraphTrainer", "TrainResult",
           "read_checkpoint", "read_step_graph"]
