"""The engine: a service stepped one step at a time (propose -> verify -> accept)."""

from .cost_model import CostModel
from .engine import Engine
from .planner import Planner

__all__ = ["CostModel", "Engine", "Planner"]
