"""Live runs: agents on real model endpoints, in real time, on real sandboxes.

- actors that talk to a model (an OpenAI-compatible endpoint, or a local transformers
  model) and the chat format they share (``aospec.live.chat``);
- ``aospec serve-trace``: an OpenAI-compatible server that streams a recorded trajectory's
  replies at a given token rate (``aospec.live.serve_trace``);
- ``aospec run``: a mini-swe-agent-style bash agent on the engine, recording its trace with
  exact versions (``aospec.live.agent``, ``aospec.live.record``, ``aospec.live.cli``).

See docs/live.md.
"""
