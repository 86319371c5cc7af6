"""The SpecBox layer under the engine (issue 13): intent routers that read the actor's
token stream and name the tool it is about to call, Markov prefetch over tool
transitions, the state-keyed result cache, and out-of-band transport of large outputs.

See docs/specbox.md.
"""
