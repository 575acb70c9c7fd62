"""Speculative decoding: proposals (``ngram``), how many tokens each sequence proposes per step
(``speculator``), and their verification against the target model's probabilities (``verify``).
docs/engine.md, "Speculative decoding", tells the mechanism and its exactness rules."""
