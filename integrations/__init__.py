"""Harness integrations on the engine's public API (issue 12): mini-swe-agent (an
Environment on aospec sandboxes and an agent that co-speculates with mini-swe-agent's own
Model), the OpenAI-compatible speculating proxy (``aospec proxy``) and the MCP server
(``aospec mcp``). See docs/integrations.md.
"""
