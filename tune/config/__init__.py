"""What a search is asked to do (`vidtune.tune.config`): its options (defaults, presets, config
file, flags) as one typed `SearchOptions`, the searched parameters, where its files go, the demo's
data, and the option reference generated from the flags.

Imports only the layers below (`vidtune`, data, training). Nothing is imported here.
"""
