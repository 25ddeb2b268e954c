"""Judging what came back: the comparison oracle (oracle), its passes (comparisons), the scored
evals and their datasets (evals/, datasets) and the proofs' shared parts (proof; each engine's
own proof is in engines/)."""
