"""Chat formats shared by data preparation, training, serving and evaluation: the chat template
(template.py: GLM-5's Jinja template or the built-in format), the reasoning block (reasoning.py),
GLM-5's tool-call markup (tool_calls.py) and the feedback log's records (feedback_log.py). Nothing
here imports engine/, api/, train/ or data/."""
