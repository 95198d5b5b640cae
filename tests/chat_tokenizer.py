"""A copy of the bundled target's tokenizer and config with a chat template added: the
bundled tokenizer has none, and `messages` needs one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from specdec.models import BUNDLED_TARGET

# a plain role-tagged template that refuses a conversation opening with the assistant
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation opens with a system or user turn') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_tokenizer_dir(into: Path) -> Path:
    """The tokenizer files and config.json of the bundled target (no weights) in `into`,
    with CHAT_TEMPLATE in tokenizer_config.json: an orchestrator's --tokenizer."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(BUNDLED_TARGET / name, into / name)
    config = json.loads((into / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (into / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return into
