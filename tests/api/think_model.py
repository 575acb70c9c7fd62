"""The think model of the Responses, Messages, reasoning and tokenize tests: a random Qwen3 whose chat
template thinks between <think> tags."""

from __future__ import annotations

import json
from pathlib import Path

API_KEY = "sk-tidal-apis"
SERVED_MODEL = "qwen3-think"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}

# Qwen3's template in miniature, in the tidal-tiny tokenizer's role tokens: tools in the system
# turn, earlier thinking and tool calls rendered back, and ``enable_thinking=false`` closing an
# empty <think> block in the generation prompt (as Qwen3's own template does); ``open_thinking=true``
# opens the block in the prompt instead, as Qwen3-Thinking-2507's and DeepSeek-R1's templates do.
THINK_TEMPLATE = (
    "{%- if tools %}<s><|system|>\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' %}<|assistant|>\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>\n"
    "{%- elif message.role == 'tool' %}<|user|>\n<tool_response>{{ message.content }}</tool_response><|end|>\n"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_thinking %}<think>\n{% endif %}"
    "{%- endif %}"
)


def make_think_model(out_dir: Path) -> str:
    """A random Qwen3 in ``out_dir`` with ``THINK_TEMPLATE`` as its chat template."""
    from hf_models import make_hf_model

    model_dir = Path(make_hf_model("qwen3", out_dir, seed=7))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINK_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(model_dir)
