"""Speculative decoding: proposers of draft tokens and the planner that decides, each step,
how many drafts each request verifies. Verification itself happens in the model runner's
forward pass and the scheduler's update (see runner/model_runner.py)."""

from llmserve.spec_decode.ngram import NgramProposer, ngram_propose
from llmserve.spec_decode.planner import StepCost, plan_drafts
from llmserve.spec_decode.proposer import Proposer, Speculator, build_proposer

__all__ = ["NgramProposer", "Proposer", "Speculator", "StepCost", "build_proposer",
           "ngram_propose", "plan_drafts"]
