"""The foundation every other package stands on: configuration, errors, options, the version.

It imports nothing of ours, so any package may import it.
"""
