"""Adaptive compression: a controller actor (:mod:`.controller`), its decision rules
(:mod:`.policy`), the cost model of a step they fit (:mod:`.model`), and the training a step
does at each compression, from the loss curve (:mod:`.efficiency`)."""

from .controller import AdaptiveController, Decision, PrometheusSource, SourceError, controller_name, start_controller
from .efficiency import EfficiencyFit, EfficiencyModel
from .model import LinkFit, Prediction, StepModel, StepSample, combine_ranks, fit_link
from .policy import CostModelPolicy, Policy, PolicyInputs, PressurePolicy, TimeToTargetPolicy, make_policy

__all__ = ["AdaptiveController", "CostModelPolicy", "Decision", "EfficiencyFit", "EfficiencyModel", "LinkFit", "Policy", "PolicyInputs", "Prediction",
           "PressurePolicy", "PrometheusSource", "SourceError", "StepModel", "StepSample", "TimeToTargetPolicy", "combine_ranks",
           "controller_name", "fit_link", "make_policy", "start_controller"]
