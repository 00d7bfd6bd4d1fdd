"""Drafting and acceptance: the Markov head's chain, DDTree, prompt lookup, sampling and the speculative acceptance
rules."""
