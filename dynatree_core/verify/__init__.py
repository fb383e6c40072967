"""Verifiers: decide which drafted nodes the target accepts. They see trees and target
distributions only, never models or caches: greedy verification (greedy.py); the node-level
solvers of lossless verification (otlp.py); bottom-up Traversal and block verification
(traversal.py); lossless verification for sampling (sampling.py); the verifiers' registry and the
one rule that pairs a policy with a verifier (registry.py).

May import: errors, core, forward.
"""

from dynatree_core.verify.greedy import Outcome, verify_greedy

__all__ = ["Outcome", "verify_greedy"]
