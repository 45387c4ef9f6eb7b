"""Data: local files of every kind and the default corpus become the token sequences computed by hand."""

import copy
import json
from pathlib import Path

import datasets
import huggingface_hub
import pandas as pd
import pytest
import torch
from tiny_assets import corpus_text, tiny_tokenizer

from hf_lowprec import data
from hf_lowprec.data import (
    default_corpus,
    detect_columns,
    load_records,
    pack_blocks,
    prepare_classification_data,
    prepare_lm_data,
    read_source,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


ROWS = [{"text": f"Row {i}: " + corpus_text(3000)[i * 40 : i * 40 + 200], "label": i % 2} for i in range(40)]


def _reference_blocks(texts, tok, block):
    ids = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]


def test_default_corpus_is_shakespeare_and_falls_back_to_pydoc(monkeypatch):
    ds, name = default_corpus()
    assert name == "shakespeare" and len(ds) >= 30
    assert any("HAMLET" in t[:200] for t in ds["text"])

    def absent():
        raise ValueError("the offline default corpus needs the shakespeare package")

    monkeypatch.setattr(data, "shakespeare_files", absent)
    ds, name = default_corpus()
    from pydoc_data.topics import topics

    assert name == "pydoc_data.topics" and len(ds) == len(topics)


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "parquet"])
def test_jsonl_csv_parquet_give_the_blocks_computed_by_hand(tmp_path, tok, suffix):
    path = tmp_path / f"data.{suffix}"
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif suffix == "csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    else:
        pd.DataFrame(ROWS).to_parquet(path)
    records, name = read_source(str(path))
    lm = prepare_lm_data(records, name, tok, 32, eval_fraction=0.1, eval_sequences=None)
    texts = [r["text"] for r in ROWS]
    assert lm.kind == "text"
    assert lm.train["input_ids"] == _reference_blocks(texts[:36], tok, 32)  # last 10% of rows held out
    assert lm.eval["input_ids"] == _reference_blocks(texts[36:], tok, 32)
    assert lm.train["labels"] == lm.train["input_ids"]
    batch = lm.collator([lm.train[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 32) and torch.equal(batch["labels"], batch["input_ids"])


def test_a_txt_file_is_one_document_whose_last_characters_are_held_out(tmp_path, tok):
    """Read line by line, each line of a .txt file ended with an EOS (11% of Hamlet's tokens); one row's held-out
    blocks were its last training blocks' neighbours, and moved with the run's length."""
    text = corpus_text(20000)
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())  # a BOM is not text
    records, name = read_source(path)
    assert records["text"] == [text]
    lm = prepare_lm_data(records, name, tok, 64, train_sequences=5, eval_sequences=2)
    cut = text.rfind("\n", 0, round(len(text) * 0.95)) + 1  # the last 5% of the characters, from a line's start
    assert round(len(text) * 0.95) - cut <= 1000
    assert lm.train["input_ids"] == _reference_blocks([text[:cut]], tok, 64)[:5]
    assert lm.eval["input_ids"] == _reference_blocks([text[cut:]], tok, 64)[:2]
    longer = prepare_lm_data(records, name, tok, 64, train_sequences=50, eval_sequences=2)
    assert longer.eval["input_ids"] == lm.eval["input_ids"] and len(longer.train) == 50
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text(text[:5000])
    (folder / "b.txt").write_text(text[5000:10000])
    assert load_records(folder)["text"] == [text[:5000], text[5000:10000]]  # a document per file
    few = datasets.Dataset.from_dict({"text": [text[:5000], text[5000:6000]]})  # the tail spans a row and a half
    split = prepare_lm_data(few, "few", tok, 16, eval_fraction=0.2, eval_sequences=None)
    start = 5000 - (1200 - 1000)
    start = text.rfind("\n", 0, start) + 1 if start - text.rfind("\n", 0, start) - 1 <= 1000 else start
    assert split.eval["input_ids"] == _reference_blocks([text[start:5000], text[5000:6000]], tok, 16)
    assert split.train["input_ids"] == _reference_blocks([text[:start]], tok, 16)
    short = prepare_lm_data(datasets.Dataset.from_dict({"text": [text[:6000]]}), "short", tok, 256)
    assert len(short.eval) and len(short.train)  # 5% of it, 300 characters, held no block of 256: a block's worth


def test_chat_and_instruction_rows_go_through_the_chat_template(tmp_path, tok):
    chats = [{"messages": [{"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"it is {i}"}]} for i in range(20)]
    pairs = [{"instruction": f"what is {i}?", "output": f"it is {i}"} for i in range(20)]
    for rows, fname in ((chats, "chat.jsonl"), (pairs, "pairs.jsonl")):
        (tmp_path / fname).write_text("\n".join(json.dumps(r) for r in rows))
        records, name = read_source(tmp_path / fname)
        lm = prepare_lm_data(records, name, tok, 64, eval_fraction=0.1)
        assert lm.kind == "chat" and len(lm.train) == 18 and len(lm.eval) == 2
        expected = tok.apply_chat_template(chats[0]["messages"], tokenize=False)
        assert tok.decode(lm.train[0]["input_ids"]) == expected
        batch = lm.collator([lm.train[i] for i in range(2)] + [{"input_ids": [5, 6], "labels": [5, 6]}])
        assert (batch["labels"][2, 2:] == -100).all() and (batch["attention_mask"][2, 2:] == 0).all()
    long_rows = [{"messages": [{"role": "user", "content": corpus_text(2000)}]}] * 3
    (tmp_path / "long.jsonl").write_text("\n".join(json.dumps(r) for r in long_rows))
    lm = prepare_lm_data(*read_source(tmp_path / "long.jsonl"), tok, 16)
    assert {len(ids) for ids in lm.train["input_ids"]} == {16}


def test_clear_errors_for_missing_files_and_columns(tmp_path, tok):
    with pytest.raises(ValueError, match=r"data file '.*missing\.txt' does not exist"):
        read_source(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"not an existing .* file, folder or Hub dataset name"):
        read_source("./not/here")
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"body": "x" * 50, "score": 1}) for _ in range(5)))
    records, name = read_source(path)
    with pytest.raises(ValueError, match=r"has no column 'text_col'; its columns are body, score"):
        prepare_lm_data(records, name, tok, 8, text_column="text_col")
    with pytest.raises(ValueError, match=r"has no text column .* its columns are body, score; name one with --text-column"):
        detect_columns(records, name)
    assert prepare_lm_data(records, name, tok, 8, text_column="body").kind == "text"
    with pytest.raises(ValueError, match=r"has no label column 'label'; its columns are body, score"):
        prepare_classification_data(records, name, tok, 32, text_column="body")
    with pytest.raises(ValueError, match=r"no complete block of 4096 tokens"):
        prepare_lm_data(records, name, tok, 4096, text_column="body")
    plain = tiny_tokenizer()
    plain.chat_template = None
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"has no chat template"):
        prepare_lm_data(*read_source(tmp_path / "c.jsonl"), plain, 8)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(ValueError, match=r"could not read data '.*broken\.jsonl' as json"):
        read_source(tmp_path / "broken.jsonl")


def test_empty_and_malformed_files_say_why_they_cannot_be_read(tmp_path):
    """datasets raises an empty StopIteration for an empty JSON-lines file and wraps the cause of others in "An error
    occurred while generating the dataset": the message gives the cause, on one line."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a b c"}\n{not json\n{"text": "d"}\n')
    (tmp_path / "bad.json").write_text('[\n  {"text": "a"},\n  {"text": oops}\n]\n')
    for name in ("empty.jsonl", "empty.txt", "blank.jsonl"):
        with pytest.raises(ValueError, match=rf"could not read data '.*{name}' as (json|text): the file is empty$"):
            read_source(tmp_path / name)
    with pytest.raises(ValueError) as bad:
        read_source(tmp_path / "bad.jsonl")
    assert str(bad.value).endswith("as json: line 2: Expecting property name enclosed in double quotes (column 2): '{not json'")
    with pytest.raises(ValueError, match=r"as json: line 3: Expecting value \(column 12\)$"):
        read_source(tmp_path / "bad.json")  # one JSON document over several lines: its line and column
    # datasets says 'Instruction "train" corresponds to no data!'
    (tmp_path / "header.csv").write_text("prompt,completion\n\n")
    with pytest.raises(ValueError, match=r"data '.*header.csv' as csv: the file has a header and no rows$"):
        read_source(tmp_path / "header.csv")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "folder" / "b.jsonl").write_text('{"text": "b"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"could not read data '.*folder' as json: .*b\.jsonl: line 2: Expecting value"):
        read_source(tmp_path / "folder")


def test_a_single_file_holds_only_the_train_split(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert len(load_records(path, split="train")) == len(ROWS)
    for split in ("validation", "bogus"):
        with pytest.raises(ValueError, match=rf"data file '.*rows\.jsonl' has no split '{split}'; its splits are train"):
            load_records(path, split=split)
    (tmp_path / "folder").mkdir()  # files not named by split: one train split too
    (tmp_path / "folder" / "part-1.jsonl").write_text(path.read_text())
    with pytest.raises(ValueError, match=r"data folder '.*folder' has no split 'test'; its splits are train"):
        load_records(tmp_path / "folder", split="test")
    assert data.default_eval_split(path) == "train" and data.default_eval_split(tmp_path / "folder") == "train"
    (tmp_path / "empty").mkdir()  # datasets' EmptyDatasetError passed through (exit 1, its words)
    with pytest.raises(ValueError, match=r"data folder '.*empty' has no split 'train'; its splits are none \(no \.txt/"):
        load_records(tmp_path / "empty")


def test_a_folder_is_split_by_file_names_as_datasets_splits_it(tmp_path, caplog, monkeypatch):
    """valid.jsonl and dev.jsonl are validation splits and eval.jsonl a test split to ``datasets.load_dataset``; only
    train/validation/test stems were: any other name made the folder one train split, held-out files trained on."""
    rows = [{"text": f"row {i}"} for i in range(6)]
    for names, splits in ((("train", "valid"), ["train", "validation"]), (("train", "test", "notes"), ["train", "test"]),
                          (("train-00000-of-00002", "train-00001-of-00002", "dev"), ["train", "validation"])):  # fmt: skip
        folder = tmp_path / "-".join(names)
        folder.mkdir()
        for i, stem in enumerate(names):
            (folder / f"{stem}.jsonl").write_text(json.dumps(rows[i]) + "\n")
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_lowprec.data"):
            train = load_records(folder)
        assert data._split_names(folder) == splits
        assert train["text"] == [r["text"] for stem, r in zip(names, rows) if stem.startswith("train")]
        assert data.default_eval_split(folder) == splits[1]
        assert len(load_records(folder, split=splits[1])) == 1
        assert ("notes.jsonl named by no split (its splits: train, test), not read" in caplog.text) == ("notes" in names)
        assert "train.jsonl" not in caplog.text  # read: not said unread
    monkeypatch.chdir(tmp_path)  # a relative folder: its files compare with the absolute ones datasets gives
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        load_records(Path("train-valid"))
    assert "not read" not in caplog.text
    with pytest.raises(ValueError, match=r"data folder '.*' has no split 'validation'; its splits are train, test$"):
        load_records(tmp_path / "train-test-notes", split="validation")


def test_a_folder_whose_readme_declares_its_splits_is_read_by_them(tmp_path, caplog):
    """A Hub dataset's card names each split's files (YAML ``configs``): datasets reads them so; split by file names
    the folder was one train split, and a run trained on the validation rows."""
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    for part, stem in (("part_a", "TRAIN"), ("part_b", "VALID")):
        rows = "".join(json.dumps({"text": f"{stem} {i}"}) + "\n" for i in range(4))
        (folder / "data" / f"{part}.jsonl").write_text(rows)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: data/part_a.jsonl\n  - split: validation\n"
                                      "    path: data/part_b.jsonl\n---\n# my dataset\n")  # fmt: skip
    expected = datasets.load_dataset(str(folder))
    assert data._split_names(folder) == list(expected) == ["train", "validation"]
    assert load_records(folder)["text"] == expected["train"]["text"] == [f"TRAIN {i}" for i in range(4)]
    assert load_records(folder, split="validation")["text"] == expected["validation"]["text"]
    assert data.default_eval_split(folder) == "validation"
    train, held_out, _ = data.read_run_source(folder)
    assert train["text"] == expected["train"]["text"] and held_out["text"] == expected["validation"]["text"]
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: data/missing.jsonl\n---\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"^data folder '.*hub': its README.md configs: "):
        load_records(folder)


def test_a_folder_save_to_disk_wrote_is_read_with_its_splits(tmp_path):
    rows = datasets.Dataset.from_dict({"text": ["a b", "c d", "e f"]})
    rows.save_to_disk(tmp_path / "one")
    assert load_records(tmp_path / "one")["text"] == rows["text"] and data._split_names(tmp_path / "one") == ["train"]
    datasets.DatasetDict({"train": rows, "validation": rows.select([0])}).save_to_disk(tmp_path / "two")
    assert load_records(tmp_path / "two", split="validation")["text"] == ["a b"]
    assert data.default_eval_split(tmp_path / "two") == "validation"
    with pytest.raises(ValueError, match=r"saved dataset '.*two' has no split 'test'; its splits are train, validation"):
        load_records(tmp_path / "two", split="test")
    # a saved DatasetDict keeps its own split names: 'valid' (or val/dev) serves as validation, as in a folder of files
    datasets.DatasetDict({"train": rows, "valid": rows.select([1])}).save_to_disk(tmp_path / "three")
    assert data.default_eval_split(tmp_path / "three") == "valid"  # eval read train, the rows a run trained on
    assert data.read_run_source(tmp_path / "three")[1]["text"] == ["c d"]  # a run holds them out (it held train's)


def test_a_folder_with_a_test_split_but_no_validation_says_finetune_holds_out_train_rows(tmp_path, caplog):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": r["text"]}) for r in ROWS[:30]))
    (folder / "eval.jsonl").write_text(json.dumps({"text": "held"}))
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        rows, held, _ = data.read_run_source(folder)
    assert held is None and len(rows) == 30 and data.default_eval_split(folder) == "test"
    assert "has a 'test' split but no validation split: a run holds out the last rows of 'train'" in caplog.text


def test_rows_without_text_are_counted_in_a_warning_and_a_tokenizer_without_eos_is_refused(tok, caplog):
    """A jsonl whose rows alternate "text" and "content": half its rows were dropped without a word. A tokenizer with
    no EOS joined documents with nothing between them (text) or failed at the first padded batch (chat)."""
    mixed = datasets.Dataset.from_list([{"text": r["text"], "content": None} if i % 2 else {"text": None, "content": r["text"]}
                                        for i, r in enumerate(ROWS)])  # fmt: skip
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        lm = prepare_lm_data(mixed, "mixed.jsonl", tok, 16, eval_sequences=100)
    assert "data 'mixed.jsonl': 20 of its 40 rows have no text in column 'text' (null or empty) and are left out (its other columns: content)" in caplog.text
    assert lm.train["input_ids"] == _reference_blocks([r["text"] for r in ROWS[1:38:2]], tok, 16)
    caplog.clear()
    blank = datasets.Dataset.from_list([{"text": "\t\t  " if i % 4 == 0 else r["text"]} for i, r in enumerate(ROWS)])
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        lm = prepare_lm_data(blank, "blank.jsonl", tok, 16, eval_sequences=100)
    assert "10 of its 40 rows have no text in column 'text' (null or empty) and are left out" in caplog.text
    blocks = [block for part in (lm.train, lm.eval) for block in part["input_ids"]]
    assert not any("\t" in tok.decode(block) for block in blocks)  # they were trained on
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        prepare_lm_data(mixed.select(range(1, 40, 2)), "odd.jsonl", tok, 16)  # a view: its rows, not the table's
    assert "no text" not in caplog.text
    import copy

    no_eos = copy.deepcopy(tok)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match=r"^the tokenizer \(\w+\) has no EOS token, which ends each document .*: tokenizer.eos_token = '...'$"):
        prepare_lm_data(datasets.Dataset.from_list(ROWS), "rows.jsonl", no_eos, 16)


def test_a_long_row_that_tokenizes_densely_is_counted_by_its_tokens_when_rows_are_held_out(tok, monkeypatch):
    """The held-out rows must make a block: a row of a block's worth of characters counted as a block untokenized
    (1,100 dashes are 18 SmolLM2 tokens), and the run stopped saying no complete block could be evaluated on. The
    tiny tokenizer makes no such tokens: the characters a token is assumed to hold at least are raised instead."""
    monkeypatch.setattr(data, "CHARS_PER_TOKEN", 1)  # a last row of 150 characters, ~90 tokens: "a block" untokenized
    rows = [r["text"][:60] for r in ROWS[:39]] + [ROWS[39]["text"][:150]]
    held = data._rows_for_a_block(datasets.Dataset.from_dict({"text": rows}), tok, "text", 1, 128)
    assert sum(len(tok(text)["input_ids"]) + 1 for text in rows[-held:]) >= 128  # with their EOS, a block's tokens


@pytest.mark.parametrize("good_rows", [1, 40])
def test_text_that_is_not_utf8_is_named_by_its_row(tmp_path, tok, good_rows):
    """Whatever the rows around it (from 20 rows on, the Arrow functions counting blank rows and sizing the held-out
    rows read the column first, and raised a bare ArrowInvalid or UnicodeDecodeError naming no row)."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "good row"}\n' * good_rows + b'{"text": "caf\xe9 au lait"}\n')  # read unchecked
    records, name = read_source(path)
    with pytest.raises(ValueError, match=rf"^row {good_rows} is not UTF-8 text \(invalid continuation byte\): re-encode "):
        prepare_lm_data(records, name, tok, 8)
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))  # the text reader decodes it itself
    with pytest.raises(ValueError, match=r"latin1\.txt' as text: not UTF-8 text \(invalid continuation byte\): re-encode"):
        read_source(tmp_path / "latin1.txt")


def test_documents_start_with_the_bos_a_tokenizer_adds_by_default(tok):
    """``add_special_tokens=False`` dropped the BOS that Llama 3 and Gemma tokenizers start a document with (and
    ``run_clm.py`` and TRL keep); an EOS the tokenizer adds itself is not doubled."""
    import copy

    from tokenizers.processors import TemplateProcessing

    bos, eos = tok.bos_token_id, tok.eos_token_id
    texts = [corpus_text(300), corpus_text(500)[300:]]
    ds = datasets.Dataset.from_dict({"text": texts})
    for template, ends in (("<|im_start|> $A", []), ("<|im_start|> $A <|endoftext|>", [])):
        llama = copy.deepcopy(tok)
        llama._tokenizer.post_processor = TemplateProcessing(
            single=template, special_tokens=[("<|im_start|>", bos), ("<|endoftext|>", eos)]
        )
        expected = [t for text in texts for t in [bos, *tok(text, add_special_tokens=False)["input_ids"], eos, *ends]]
        assert pack_blocks(ds, llama, detect_columns(ds, "d"), 16) == [
            expected[i : i + 16] for i in range(0, len(expected) - 15, 16)
        ]


def test_the_offline_corpus_is_read_by_the_name_runs_record(tmp_path, monkeypatch):
    """Records and cards name the default corpus 'shakespeare': --data shakespeare reads it (it went to the Hub);
    a local folder of that name is still that folder."""
    rows, name = read_source("shakespeare")
    default_rows, default_name = read_source(None)
    assert name == default_name and rows["text"] == default_rows["text"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "mine.txt").write_text("my own lines\n")
    assert read_source("shakespeare")[0]["text"] == ["my own lines\n"]


def test_hub_dataset_names_go_through_datasets(monkeypatch):
    # this machine cannot reach the Hub: offline mode makes datasets answer at once, through the same code path
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"could not load dataset 'someone/some-dataset' \(split 'train'\) through datasets"):
        load_records("someone/some-dataset")


def test_classification_rows(tmp_path, tok):
    path = tmp_path / "cls.csv"
    pd.DataFrame(ROWS).to_csv(path, index=False)
    ds = prepare_classification_data(*read_source(path), tok, 16, max_rows=10)
    assert len(ds) == 10 and ds["labels"] == [r["label"] for r in ROWS[:10]]
    assert ds["input_ids"][3] == tok(ROWS[3]["text"], truncation=True, max_length=16)["input_ids"]


def test_classification_accuracy_counts_rows_and_leaves_the_training_mode_as_it_was(tmp_path, tok):
    """Accuracy over the rows, against argmax of the model's logits row by row; a model evaluated mid-training goes
    on training with its dropout (it was left in eval mode)."""
    from conftest import tiny_bert
    from transformers import DataCollatorWithPadding

    from hf_lowprec.metrics import classification_accuracy

    path = tmp_path / "cls.csv"
    pd.DataFrame(ROWS).to_csv(path, index=False)
    rows = prepare_classification_data(*read_source(path), tok, 16, max_rows=12)
    model = tiny_bert()
    model.resize_token_embeddings(len(tok))
    model.train()
    result = classification_accuracy(model, rows, DataCollatorWithPadding(tok), batch_size=5)
    assert model.training
    model.eval()
    with torch.no_grad():
        right = [int(model(input_ids=torch.tensor([r["input_ids"]])).logits.argmax(-1)) == r["labels"] for r in rows]
    assert result == {"accuracy": pytest.approx(sum(right) / 12), "rows": 12}


def test_pack_blocks_stops_early():
    tok = tiny_tokenizer()
    ds = datasets.Dataset.from_dict({"text": [corpus_text(4000)] * 50})
    cols = detect_columns(ds, "mem")
    blocks = pack_blocks(ds, tok, cols, 32, max_blocks=3)
    assert blocks == _reference_blocks(ds["text"][:1], tok, 32)[:3]  # three blocks: the first text's first three


def test_sharegpt_rows_and_completion_only_labels(tmp_path, tok):
    shared = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": f"what is {i}?"},
                                 {"from": "gpt", "value": f"it is {i}"}]} for i in range(10)]  # fmt: skip
    (tmp_path / "sharegpt.jsonl").write_text("\n".join(json.dumps(r) for r in shared))
    records, name = read_source(tmp_path / "sharegpt.jsonl")
    everything = prepare_lm_data(records, name, tok, 64, eval_fraction=0.1)
    completions = prepare_lm_data(records, name, tok, 64, eval_fraction=0.1, train_on="completions")
    roles = [{"role": r, "content": c} for r, c in (("system", "be brief"), ("user", "what is 0?"), ("assistant", "it is 0"))]
    assert tok.decode(everything.train[0]["input_ids"]) == tok.apply_chat_template(roles, tokenize=False)
    assert everything.train[0]["labels"] == everything.train[0]["input_ids"]
    ids, labels = completions.train[0]["input_ids"], completions.train[0]["labels"]
    assert ids == everything.train[0]["input_ids"]
    # the counted tokens are exactly the assistant turn as ChatML renders it: "it is 0<|im_end|>\n"
    counted = [t for t, label in zip(ids, labels) if label != -100]
    assert tok.decode(counted) == "it is 0<|im_end|>\n" and labels[: len(ids) - len(counted)] == [-100] * (len(ids) - len(counted))
    with pytest.raises(ValueError, match="ShareGPT"):
        prepare_lm_data(datasets.Dataset.from_dict({"messages": [[{"from": "robot", "value": "x"}]]}), "bad", tok, 64)
    with pytest.raises(ValueError, match="train_on 'prompts': choose one of auto, all, completions"):
        prepare_lm_data(records, name, tok, 64, train_on="prompts")
    text = datasets.Dataset.from_dict({"text": [corpus_text(2000)] * 4})  # every token a target: nothing to leave out
    with pytest.raises(ValueError, match="train_on 'completions' needs chat or instruction rows .* data 'plain' is plain text"):
        prepare_lm_data(text, "plain", tok, 64, train_on="completions")


def test_chat_rows_pad_on_the_right_whatever_side_the_tokenizer_pads(tok):
    """A tokenizer that pads on the left (a generation setting, as some chat checkpoints ship it) padded training rows
    on the left: each scored its first token from a pad's logits and shifted absolute positions, so losses changed with
    the batch size. Rows pad on the right, as TRL's collators pad them; the tokenizer keeps its side."""
    left = copy.copy(tok)
    left.padding_side = "left"
    rows = [{"messages": [{"role": "user", "content": "hi " * (1 + 3 * i)}, {"role": "assistant", "content": "ok"}]}
            for i in range(4)]  # fmt: skip
    lm = prepare_lm_data(datasets.Dataset.from_list(rows), "chat", left, 64, eval_fraction=0.25)
    features = [lm.train[i] for i in range(2)]
    batch = lm.collator(features)
    short = len(features[0]["input_ids"])
    assert short < batch["input_ids"].shape[1] and left.padding_side == "left"
    assert batch["input_ids"][0, :short].tolist() == features[0]["input_ids"]
    assert batch["labels"][0, :short].tolist() == features[0]["labels"] and (batch["labels"][0, short:] == -100).all()
    assert batch["attention_mask"][0].tolist() == [1] * short + [0] * (batch["input_ids"].shape[1] - short)


def test_an_instruction_pairs_context_follows_its_instruction_as_alpacas_input_does(tok):
    """databricks-dolly's rows are instruction/context/response: the context the answer rests on was left out."""
    rows = [{"instruction": f"Who is named? {i}", "context": f"Alice met Bob {i}.", "response": "Alice and Bob.",
             "category": "closed_qa"} for i in range(4)]  # fmt: skip
    lm = prepare_lm_data(datasets.Dataset.from_list(rows), "dolly", tok, 128, eval_fraction=0.25)
    prompt = {"role": "user", "content": "Who is named? 0\n\nAlice met Bob 0."}
    expected = tok.apply_chat_template([prompt, {"role": "assistant", "content": "Alice and Bob."}], tokenize=False)
    assert tok.decode(lm.train[0]["input_ids"]) == expected


def test_csv_cells_are_their_text_even_where_pandas_reads_a_missing_value(tmp_path, tok):
    """pandas reads "NA", "null", "None" and an empty cell as missing: a text row "NA" was dropped as empty, and an
    answer "None" refused as no text."""
    pd.DataFrame({"question": [f"q{i}" for i in range(4)], "answer": ["None", "NA", "null", "yes"]}).to_csv(
        tmp_path / "qa.csv", index=False
    )
    records, _ = read_source(tmp_path / "qa.csv")
    assert records["answer"] == ["None", "NA", "null", "yes"]
    (tmp_path / "blank.csv").write_text("question,answer,label\nq0,,1\nq1,a,\n")  # an empty cell is still missing
    assert read_source(tmp_path / "blank.csv")[0].to_dict() == {"question": ["q0", "q1"], "answer": [None, "a"], "label": [1, None]}
    lm = prepare_lm_data(records, "qa", tok, 64, eval_fraction=0.25)
    assert tok.decode([t for t, label in zip(lm.train[0]["input_ids"], lm.train[0]["labels"]) if label != -100]).startswith("None")


def test_upper_case_extensions_are_read_as_datasets_reads_them(tmp_path):
    """``DATA.JSONL`` was refused as "not an existing file", and in a folder left out without a word."""
    (tmp_path / "UP.JSONL").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(3)))
    assert load_records(tmp_path / "UP.JSONL")["text"] == ["row 0", "row 1", "row 2"]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "A.JSONL").write_text(json.dumps({"text": "a"}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": "b"}) + "\n")
    assert sorted(load_records(folder)["text"]) == ["a", "b"]


def test_classification_labels_that_are_no_class_ids_are_named_with_their_row(tok):
    """String or missing labels: one line naming the column, the row and the value (``int()``'s message named none)."""
    for labels, held in ((["pos", "neg"], "str 'pos'"), ([1, None], "NoneType None"), ([0, 1.5], "float 1.5")):
        ds = datasets.Dataset.from_dict({"text": ["good", "bad"], "label": labels})
        row = 0 if labels[0] == "pos" else 1
        said = rf"data 'cls': column 'label' must hold integer class ids \(0, 1, \.\.\.\); row {row} holds {held}"
        with pytest.raises(ValueError, match=said):
            prepare_classification_data(ds, "cls", tok, 16)
    floats = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [1, 0.0]})  # a float column of whole numbers
    assert prepare_classification_data(floats, "cls", tok, 16)["labels"] == [1, 0]


def test_held_out_rows_grow_to_a_blocks_worth_and_are_never_trained_on(tok):
    """Rows are held out as rows, so that evaluated text was never trained on (the last training blocks were once
    evaluated instead): 5% of the rows, or more where those hold less than a block's worth of characters (one short
    row was refused: "no complete block to evaluate on", whatever the data's size), at most half of them."""
    text = corpus_text(20_000)
    rows = [text[i * 400 : (i + 1) * 400] for i in range(19)] + ["short."]  # 5%: the short row alone
    lm = prepare_lm_data(datasets.Dataset.from_dict({"text": rows}), "rows", tok, 32, eval_fraction=0.05, eval_sequences=100)
    assert lm.eval["input_ids"] == _reference_blocks(rows[-2:], tok, 32)  # "short." and the row before it
    assert lm.train["input_ids"] == _reference_blocks(rows[:-2], tok, 32)
    texts = [text[i * 400 : (i + 1) * 400] for i in range(30)]
    gaps = texts + [""] * 9 + [None] + ["short."]  # rows without text passed over: the last text rows make one
    lm = prepare_lm_data(datasets.Dataset.from_dict({"text": gaps}), "gaps", tok, 32, eval_fraction=0.05, eval_sequences=100)
    assert lm.eval["input_ids"] == _reference_blocks([texts[29], "short."], tok, 32)
    # a blank row of whitespace too (its tokens counted, but packing leaves it out: "no complete block to evaluate on")
    blank = texts + ["short.", " \n\t " * 300]
    lm = prepare_lm_data(datasets.Dataset.from_dict({"text": blank}), "blank", tok, 32, eval_fraction=0.05, eval_sequences=100)
    assert lm.eval["input_ids"] == _reference_blocks([texts[29], "short."], tok, 32)


def test_completion_labels_refuse_a_template_that_renders_the_last_turn_otherwise(tok):
    """Qwen3's template adds an empty think block to the last assistant turn alone: rendered as the last message, an
    earlier turn is longer than in the whole conversation, so its end reached into the next user turn, which was
    trained on. The turns' bounds are refused instead, naming the row and the way out; ``train_on="all"`` trains."""
    import copy

    qwen3_like = copy.deepcopy(tok)
    qwen3_like.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
        "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    turns = [("user", "hi"), ("assistant", "Hello!"), ("user", "what is two plus two"), ("assistant", "Four.")]
    ds = datasets.Dataset.from_dict({"messages": [[{"role": r, "content": c} for r, c in turns]] * 6})
    with pytest.raises(ValueError, match=r"chat data row 0: the chat template renders assistant turn 1 otherwise when "
                                         r"it ends the conversation.*use train_on 'all'"):  # fmt: skip
        prepare_lm_data(ds, "qwen3", qwen3_like, 64, train_on="completions")
    assert len(prepare_lm_data(ds, "qwen3", qwen3_like, 64).train) == 5


def test_text_is_tokenized_in_batch_calls_and_only_as_far_as_needed(tok):
    calls, chars = [], []

    class Counting:  # the tokenizer as it is, counting the texts of each call and their characters
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, texts, **kw):
            calls.append(len(texts) if isinstance(texts, list) else 1)
            chars.append(sum(map(len, texts)) if isinstance(texts, list) else len(texts))
            return self.inner(texts, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    short = datasets.Dataset.from_dict({"text": [corpus_text(400)[i::3] for i in range(3)] * 40})
    prepare_lm_data(short, "short", Counting(tok), 16)
    # one call for the last row's start (how many rows make a held-out block), one for the 114 training rows, one for
    # the 6 held out: not one call a row
    assert calls == [1, 114, 6], calls
    calls.clear()
    long = datasets.Dataset.from_dict({"text": [corpus_text(80_000)] * 10})
    prepare_lm_data(long, "long", Counting(tok), 16, train_sequences=2, eval_sequences=2)
    assert sum(calls) <= 2, calls  # 2 blocks need the first row of each split, not all ten
    # one long document (a .txt file): a few blocks read its start, the same tokens as the whole text's
    document = datasets.Dataset.from_dict({"text": [corpus_text(300_000)]})
    for blocks in (3, 40):
        chars.clear()
        got = pack_blocks(document, Counting(tok), detect_columns(document, "d"), 16, max_blocks=blocks)
        assert got == _reference_blocks(document["text"], tok, 16)[:blocks]
        assert chars == [chars[0]] and chars[0] <= 8 * (16 * blocks + 64), chars  # its start, not 300,000


def test_chat_rows_without_a_target_in_their_block_are_left_out_and_counted(tok, caplog):
    """A row with no assistant turn, or whose prompt fills the block, has nothing to learn under
    ``train_on="completions"``; a batch of them only would have a loss of 0/0."""
    turn = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "it is"}]
    rows = [turn] * 10 + [turn[:1]] * 7 + [[{"role": "user", "content": corpus_text(2000)}, turn[1]]] * 3
    ds = datasets.Dataset.from_dict({"messages": rows[12:] + rows[:12]})  # 2 rows left out among the 4 held out
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        lm = prepare_lm_data(ds, "mixed", tok, 64, eval_fraction=0.2, train_on="completions")
    assert len(lm.train) + len(lm.eval) == 10
    assert all(any(label != -100 for label in labels[1:]) for labels in [*lm.train["labels"], *lm.eval["labels"]])
    said = "data 'mixed': 10 of the 20 chat rows read left out, with no assistant token within their first 64"
    assert said in caplog.text
    assert len(prepare_lm_data(ds, "mixed", tok, 64, eval_fraction=0.2).train) == 16  # every token counts: all kept
    with pytest.raises(ValueError, match=r"data 'last' leaves nothing to evaluate on: its held-out chat rows all have "
                                         r"no assistant token within their first 64 tokens"):  # fmt: skip
        last = datasets.Dataset.from_dict({"messages": rows})
        prepare_lm_data(last, "last", tok, 64, eval_fraction=0.2, train_on="completions")
    only_prompts = datasets.Dataset.from_dict({"messages": [turn[:1]] * 5})
    caplog.clear()
    with pytest.raises(ValueError, match=r"data 'prompts' has no chat row to train on: all have no assistant token "
                                         r"within their first 64 tokens .* \(--train-on all\)"):  # fmt: skip
        prepare_lm_data(only_prompts, "prompts", tok, 64, train_on="completions")
    assert "left out" not in caplog.text  # the error alone says it, in one line


def test_values_that_are_not_text_are_refused_naming_their_column_and_row(tok):
    """``str()`` of a list or a number would train on its Python spelling; empty and missing values are skipped."""
    words = datasets.Dataset.from_dict({"text": [corpus_text(500), None, "", corpus_text(600)]})
    assert prepare_lm_data(words, "gaps", tok, 16).kind == "text"
    for values, kind in (([["The", "assert"]] * 4, "list"), ([7, 14, 0, 1], "int")):
        with pytest.raises(ValueError, match=rf"column 'text' must hold text \(strings\); row 0 holds {kind} "):
            prepare_lm_data(datasets.Dataset.from_dict({"text": values}), "odd", tok, 16)
    with pytest.raises(ValueError, match=r"column 'text' must hold text \(strings\); row 0 holds int"):
        prepare_classification_data(datasets.Dataset.from_dict({"text": [4, 5], "label": [0, 1]}), "c", tok, 8)
    user = {"role": "user", "content": "what is it?"}
    null = [[user, {"role": "assistant", "content": "it is"}]] * 3 + [[user, {"role": "assistant", "content": None}]]
    with pytest.raises(ValueError, match=r"^column 'messages', row 3, message 1 \(assistant\): its content is null$"):
        prepare_lm_data(datasets.Dataset.from_dict({"messages": null}), "null", tok, 64)
    mixed = datasets.Dataset.from_list([{"messages": [user, {"role": "assistant", "content": "it is"}]}] * 3 + [{"text": "plain"}])
    with pytest.raises(ValueError, match=r"^column 'messages' must hold lists of messages; row 3 has none \(null\): rows of one schema expected$"):
        prepare_lm_data(mixed, "mixed", tok, 64)
    with pytest.raises(ValueError, match=r"^data 'one' has 1 row: none is left to hold out for evaluation; add rows$"):
        prepare_lm_data(datasets.Dataset.from_dict({"messages": null[:1]}), "one", tok, 64)
    empty_validation = datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    with pytest.raises(ValueError, match=r"^data 'splits': its validation split has no rows$"):
        prepare_lm_data(datasets.Dataset.from_list(ROWS), "splits", tok, 16, held_out_records=empty_validation)
    sharegpt = [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]] * 2
    with pytest.raises(ValueError, match=r"^column 'conversations', row 0, message 1 \(gpt\): its value is null$"):
        prepare_lm_data(datasets.Dataset.from_dict({"conversations": sharegpt}), "sharegpt", tok, 64)
    numbers = datasets.Dataset.from_dict({"text": [5, 6], "body": ["a", "b"]})
    with pytest.raises(ValueError, match=r"^data 'n': column 'text' holds int64 values, not text; its text columns are body: name one with --text-column$"):
        prepare_lm_data(numbers, "n", tok, 16)
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "it?"}]}]
    as_parts = prepare_lm_data(datasets.Dataset.from_dict({"messages": [parts] * 2}), "parts", tok, 64)
    assert as_parts.train[0]["input_ids"] == tok.apply_chat_template([user], tokenize=True)["input_ids"]


def test_a_validation_split_is_the_runs_held_out_data(tmp_path, tok):
    """A folder of train.jsonl + validation.jsonl (or a Hub dataset with a validation split): a run trains on every
    train row and holds out the validation rows, as transformers' run_clm.py does; otherwise the last rows."""
    from hf_lowprec.data import read_run_source

    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": r["text"]}) for r in ROWS[:30]))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps({"text": r["text"]}) for r in ROWS[30:]))
    rows, held, name = read_run_source(folder)
    assert len(rows) == 30 and held["text"] == [r["text"] for r in ROWS[30:]]
    lm = prepare_lm_data(rows, name, tok, 16, eval_sequences=100, held_out_records=held)
    assert lm.eval["input_ids"] == _reference_blocks([r["text"] for r in ROWS[30:]], tok, 16)
    assert lm.train["input_ids"] == _reference_blocks([r["text"] for r in ROWS[:30]], tok, 16)
    assert read_run_source(folder, split="validation")[1] is None  # training on the validation split: no other
    single = tmp_path / "rows.jsonl"
    single.write_text((folder / "train.jsonl").read_text())
    assert read_run_source(single)[1] is None and read_run_source(None)[1] is None
    (folder / "validation.jsonl").write_text("\n".join(json.dumps({"body": r["text"]}) for r in ROWS[30:]))
    with pytest.raises(ValueError, match=r"its validation split has no column 'text', which its train rows have; its columns are body$"):
        prepare_lm_data(*read_run_source(folder)[:1], "splits", tok, 16, held_out_records=read_run_source(folder)[1])


def test_pairs_train_on_their_completions_and_conversations_on_every_token_by_default(tok):
    """TRL's SFTTrainer defaults: the loss of prompt-completion rows counts the completions (it counted the prompt and
    the template's system prompt too), conversations count every token; pairs of message lists are read."""
    pairs = datasets.Dataset.from_dict({"prompt": [f"what is {i}?" for i in range(10)],
                                        "completion": [f"it is {i}" for i in range(10)]})  # fmt: skip
    auto = prepare_lm_data(pairs, "pairs", tok, 64)
    assert auto.train_on == "completions"
    assert auto.train["labels"] == prepare_lm_data(pairs, "pairs", tok, 64, train_on="completions").train["labels"]
    counted = [t for t, label in zip(auto.train[0]["input_ids"], auto.train[0]["labels"]) if label != -100]
    assert tok.decode(counted) == "it is 0<|im_end|>\n"
    turns = [[{"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"it is {i}"}] for i in range(10)]
    chats = datasets.Dataset.from_dict({"messages": turns})
    every = prepare_lm_data(chats, "chats", tok, 64)
    assert every.train_on == "all" and every.train["labels"] == every.train["input_ids"]
    conversational = datasets.Dataset.from_dict({"prompt": [t[:1] for t in turns], "completion": [t[1:] for t in turns]})
    assert prepare_lm_data(conversational, "c", tok, 64).train["labels"] == auto.train["labels"]
    earlier = [{"role": "assistant", "content": "an earlier answer"}, {"role": "user", "content": "and now?"}]
    longer = datasets.Dataset.from_dict({"prompt": [t[:1] + earlier for t in turns], "completion": [t[1:] for t in turns]})
    row = prepare_lm_data(longer, "c", tok, 64).train[0]  # the prompt's assistant turn is prompt: not trained on
    assert tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]) == "it is 0<|im_end|>\n"


def test_empty_conversations_are_left_out_and_cut_rows_are_counted(tok, caplog):
    """An empty conversation stopped the run ("Cannot apply chat template to an empty conversation"); a conversation
    opening on an assistant turn could not be rendered before that turn; rows cut to the block went unsaid."""
    turn = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "it is"}]
    long = [{"role": "user", "content": "tell"}, {"role": "assistant", "content": corpus_text(1000)}]
    opening = [{"role": "assistant", "content": "hello"}, *turn]
    ds = datasets.Dataset.from_dict({"messages": [turn] * 6 + [[]] * 2 + [long] * 3 + [opening] * 9})
    with caplog.at_level("WARNING", logger="hf_lowprec.data"):
        lm = prepare_lm_data(ds, "d", tok, 64, eval_fraction=0.1, train_on="completions")
    assert len(lm.train) == 16 and len(lm.eval) == 2
    assert "data 'd': 2 of the 20 chat rows read left out" in caplog.text
    assert "data 'd': 3 of the 18 chat rows the run takes are longer than 64 tokens and cut to them" in caplog.text
    ids, labels = lm.eval[0]["input_ids"], lm.eval[0]["labels"]  # an opening row: its first turn is not a target
    assert tok.decode([t for t, label in zip(ids, labels) if label != -100]) == "it is<|im_end|>\n"
