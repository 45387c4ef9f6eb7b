"""Tiny offline assets for the CLI/hub/data tests: a BPE tokenizer with a chat template, a tiny Llama
saved to disk with it, a text corpus, and a local stand-in for the Hub's HTTP API."""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
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


def validate_card_metadata(content: str) -> list[str]:
    """Errors in a model card's YAML front matter (empty when it passes the stand-in's checks)."""
    import yaml
    from huggingface_hub import ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    if not content.startswith("---\n"):
        return ["no YAML front matter"]
    try:
        meta = yaml.safe_load(content.split("---\n")[1])
        if not isinstance(meta, dict):
            return ["metadata is not a mapping"]
        if "model-index" in meta:
            model_index_to_eval_results(meta["model-index"])
        ModelCardData(**meta, ignore_metadata_errors=False)
    except Exception as e:
        return [f"{type(e).__name__}: {e}"]
    return []


class HubStandIn:
    """A local stand-in for the Hub endpoints ``create_repo`` and ``upload_folder`` call.

    Implements ``POST /api/repos/create``, ``GET /api/{type}s/{repo}`` (``repo_info``: its id and visibility),
    ``POST /api/validate-yaml`` (a subset of the Hub's checks:
    the README's front matter must be a YAML mapping whose ``model-index`` parses with
    huggingface_hub's own parser and whose fields ``ModelCardData`` accepts strictly),
    ``POST /api/{type}s/{repo}/preupload/{rev}`` (every file "regular", so its bytes travel base64
    inside the commit), ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON of added and deleted files; a ``refs/pr/N``
    revision commits to pull request N), ``GET /api/{type}s/{repo}/tree/{rev}`` (the main branch's files) and, for ``create_pr``, ``POST``/``GET /api/{type}s/{repo}/discussions``.
    A repo created without an organization belongs to :attr:`user`.
    Records every request's headers, the validated cards, the pull requests and the files committed
    to each repo's main branch (``files``) or pull requests (``pr_files``).
    """

    user = "me"  # whose token every request carries

    def __init__(self):
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.pull_requests: list[str] = []
        self.pr_files: dict[str, dict[str, bytes]] = {}
        self.validated: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, payload: dict | list):
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
                if path == "/api/validate-yaml":
                    content = json.loads(raw)["content"]
                    errors = validate_card_metadata(content)
                    if errors:
                        return self._reply(400, {"errors": [{"message": e} for e in errors]})
                    standin.validated.append(content)
                    return self._reply(200, {"warnings": []})
                if path == "/api/repos/create":
                    data = json.loads(raw)
                    # a name without organization goes under the token's user, as on the Hub; the stand-in knows one
                    repo = f"{data.get('organization') or standin.user}/{data['name']}"
                    if repo in standin.repos:
                        return self._reply(409, {"error": "You already created this model repo", "url": f"http://{self.headers['Host']}/{repo}"})
                    standin.repos[repo] = data
                    standin.files.setdefault(repo, {})
                    return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
                parts = path.split("/")  # ['', 'api', 'models', owner, name, action, rev...]
                if len(parts) >= 6 and parts[1] == "api":
                    repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if repo not in standin.repos:
                        return self._reply(404, {"error": f"Repository {repo} not found"})
                    if action == "preupload":
                        files = json.loads(raw)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
                    url = f"http://{self.headers['Host']}/{repo}"
                    if action == "discussions":
                        standin.pull_requests.append(repo)
                        return self._reply(200, {"num": len(standin.pull_requests)})
                    if action == "commit":
                        revision = urllib.parse.unquote("/".join(parts[6:]))
                        main = standin.files[repo]  # a pull request starts from the main branch
                        target = standin.pr_files.setdefault(revision, dict(main)) if revision.startswith("refs/pr/") else main
                        for line in raw.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "file":
                                target[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                            elif item["key"] == "deletedFile":
                                del target[item["value"]["path"]]
                        return self._reply(200, {"commitUrl": f"{url}/commit/{'1' * 40}", "commitOid": "1" * 40})
                return self._reply(404, {"error": f"stand-in does not implement POST {path}"})

            def do_GET(self):
                standin.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers), "body": b""})
                parts = self.path.split("?")[0].split("/")  # ['', 'api', 'models', owner, name, 'discussions', num]
                if len(parts) == 5 and parts[1] == "api":  # repo_info
                    repo = f"{parts[3]}/{parts[4]}"
                    if repo not in standin.repos:
                        return self._reply(404, {"error": f"Repository {repo} not found"})
                    created = standin.repos[repo]
                    private = created.get("visibility") == "private" or created.get("private") is True
                    return self._reply(200, {"id": repo, "private": private, "sha": "1" * 40})
                if len(parts) >= 7 and parts[5] == "tree":  # list_repo_tree of the main branch, one page
                    listing = standin.files.get(f"{parts[3]}/{parts[4]}", {})
                    return self._reply(200, [{"type": "file", "path": name, "size": len(data), "oid": "0" * 40}
                                             for name, data in sorted(listing.items())])  # fmt: skip
                if len(parts) == 7 and parts[5] == "discussions":
                    repo, num = f"{parts[3]}/{parts[4]}", int(parts[6])
                    return self._reply(200, {
                        "title": "Upload", "num": num, "author": {"name": "me"}, "createdAt": "2026-01-01T00:00:00.000Z",
                        "status": "draft", "repo": {"name": repo, "type": "model"}, "isPullRequest": True, "events": [],
                        "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [],
                    })  # fmt: skip
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


def tensorboard_scalars(folder: Path) -> dict[str, list[float]]:
    """``{tag: [values]}`` of every TensorBoard event file under ``folder`` (TFRecord framing read by hand)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[float]] = {}
    for path in folder.rglob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its CRC, the record, its CRC
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(value.simple_value)
    return scalars
