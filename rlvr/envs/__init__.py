"""Tools and environments for multi-turn rollouts (agents): tools as plain functions run in the code
sandbox (`tools`, `builtin_tools`), tool calls parsed in the model's format (`parsers`), the
gym-style environment protocol (`base`) with the built-in tool-calling loop (`tool_env`) and users'
classes in processes of their own (`hosted`), conversations rendered to ids turn by turn through
the chat template (`chat`), and the trajectory record the engine loop and the trainer share
(`trajectory`)."""
