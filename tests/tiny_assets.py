"""Tiny offline assets for the CLI/hub/data tests: a BPE tokenizer with a chat template, a tiny Llama
saved to disk with it, a text corpus, and a local stand-in for the Hub's HTTP API."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus_text(chars: int = 60_000) -> str:
    """English prose from Python's own help topics (always installed)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def tiny_tokenizer(vocab: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in well under a second, with ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def save_tiny_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Llama (hidden 64) and its tokenizer saved with ``save_pretrained`` under ``path``."""
    tok = tiny_tokenizer()
    cfg = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class HubStandIn:
    """A local stand-in for the Hub endpoints ``create_repo`` and ``upload_folder`` call.

    Implements ``POST /api/repos/create``, ``POST /api/{type}s/{repo}/preupload/{rev}`` (every
    file "regular", so its bytes travel base64 inside the commit) and
    ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON). Records every request's headers and the
    files committed per repo.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.pull_requests: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, payload: dict):
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                standin.requests.append({"method": "POST", "path": self.path, "headers": dict(self.headers), "body": raw})
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    data = json.loads(raw)
                    repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    standin.repos[repo] = data
                    standin.files.setdefault(repo, {})
                    return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
                parts = path.split("/")  # ['', 'api', 'models', owner, name, action, rev]
                if len(parts) >= 7 and parts[1] == "api":
                    repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if repo not in standin.repos:
                        return self._reply(404, {"error": f"Repository {repo} not found"})
                    if action == "preupload":
                        files = json.loads(raw)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
                    if action == "commit":
                        for line in raw.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "file":
                                standin.files[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                        pr = "create_pr=1" in self.path
                        url = f"http://{self.headers['Host']}/{repo}"
                        reply = {"commitUrl": f"{url}/commit/{'1' * 40}", "commitOid": "1" * 40}
                        if pr:
                            reply["pullRequestUrl"] = f"{url}/discussions/1"
                            standin.pull_requests.append(repo)
                        return self._reply(200, reply)
                return self._reply(404, {"error": f"stand-in does not implement POST {path}"})

            def do_GET(self):
                standin.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers), "body": b""})
                return self._reply(404, {"error": f"stand-in does not implement GET {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
