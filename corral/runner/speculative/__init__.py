"""Speculative decoding's drafts: the n-gram index they come from and how many to ask for."""
