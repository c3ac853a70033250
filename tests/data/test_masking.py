"""Masked-LM batches: statistics, whole-word and entity integrity, determinism, special tokens.

    python -m pytest tests/data/test_masking.py -q

On the tiny gold-segmented People's Daily corpus (`tiny_corpus`: 80 articles, 2500-piece BPE,
`.wbd` from the corpus's own segmentation) through the real `MLMData`.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

from llmtrain.data.config import DataConfig, MaskingConfig
from llmtrain.data.mlm import MLMData
from llmtrain.tokenizer import load_tokenizer

STRATEGIES = ("token", "whole_word", "ngram", "entity")


@pytest.fixture(scope="module")
def gold_lexicon(tiny_corpus, tmp_path_factory):
    """Person/place/organisation names of the corpus's gold tags, built by the lexicon command."""
    from llmtrain.data.lexicon import main

    jsonl = os.path.join(os.path.dirname(tiny_corpus["prefix"]), "pd.jsonl")
    out = tmp_path_factory.mktemp("lexicon") / "entities.txt"
    assert main(["--input", jsonl, "--pos-key", "pos", "--output", str(out)]) == 0
    return str(out)


def data_cfg(corpus, seq_len=128, **masking) -> DataConfig:
    cfg = OmegaConf.structured(DataConfig)
    cfg.prefixes, cfg.tokenizer, cfg.seq_len, cfg.num_workers = [corpus["prefix"]], corpus["tokenizer"], seq_len, 0
    for k, v in masking.items():
        cfg.masking[k] = v
    return cfg


def mlm(corpus, G=16, m=4, rank=0, world=1, seed=1234, seq_len=128, **masking) -> MLMData:
    return MLMData(data_cfg(corpus, seq_len, **masking), seed, G, m, rank, world)


def masking_for(strategy, lexicon):
    return dict(strategy=strategy, entity_source="lexicon", lexicon=lexicon) if strategy == "entity" else \
        dict(strategy=strategy)


def units_of(flags, maskable):
    """[S] word-start flags -> list of (start, end) units as the masker defines them (specials alone)."""
    starts = flags.astype(bool).copy()
    starts[0] = True
    starts |= ~maskable
    starts[1:] |= ~maskable[:-1]
    idx = list(np.nonzero(starts)[0]) + [len(flags)]
    return list(zip(idx[:-1], idx[1:]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_masked_fraction_per_batch_and_80_10_10(strategy, tiny_corpus, gold_lexicon):
    data = mlm(tiny_corpus, **masking_for(strategy, gold_lexicon))
    tok = data.tokenizer
    kinds = np.zeros(3)
    for _ in range(12):
        for mb in data.next_step():
            lab, inp, sel = mb["labels"], mb["input_ids"], mb["loss_mask"].astype(bool)
            maskable = data.masker.maskable(lab)
            frac = sel.sum() / maskable.sum()
            assert abs(frac - 0.15) <= 0.01, (strategy, frac)
            assert (sel.sum(axis=1) >= 1).all()  # every sample bears loss
            assert np.array_equal(lab[~sel], inp[~sel])  # only selected positions change
            kinds += [(sel & (inp == tok.mask_id)).sum(), (sel & (inp != lab) & (inp != tok.mask_id)).sum(),
                      (sel & (inp == lab)).sum()]
    share = kinds / kinds.sum()
    # ~1900 selected tokens: 3 standard deviations of a 10% share are ~0.02
    assert abs(share[0] - 0.8) < 0.03 and abs(share[1] - 0.1) < 0.025 and abs(share[2] - 0.1) < 0.025, share


def test_fraction_at_512_and_other_probabilities(tiny_corpus):
    for prob, seq_len in ((0.15, 512), (0.3, 128), (0.05, 256)):
        data = mlm(tiny_corpus, G=8, m=8, seq_len=seq_len, prob=prob)
        for mb in data.next_step():
            frac = mb["loss_mask"].sum() / data.masker.maskable(mb["labels"]).sum()
            assert abs(frac - prob) <= 0.01, (prob, seq_len, frac)


def test_word_flags_are_aligned_with_the_gold_segmentation(tiny_corpus, pd_records_80):
    """Tokens grouped by the .wbd flags decode to runs of consecutive gold words, document by document."""
    from llmtrain.data.indexed import IndexedDataset

    ds = IndexedDataset(tiny_corpus["prefix"])
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    flags_all = ds.side("wbd")
    multi = 0
    for d, rec in enumerate(pd_records_80[:40]):
        s, n = int(ds.starts[d]), int(ds.sizes[d])
        ids, flags = np.asarray(ds.tokens[s:s + n]), np.asarray(flags_all[s:s + n])
        assert ids[-1] == tok.eod_id and flags[-1] == 1
        bounds = list(np.nonzero(flags[:-1])[0]) + [n - 1]
        assert bounds[0] == 0
        words = list(rec["words"])
        for a, b in zip(bounds[:-1], bounds[1:]):
            text = tok.decode(ids[a:b])
            got = ""
            while len(got) < len(text):
                got += words.pop(0)
            assert got == text, (d, a, text, got)
            multi += (b - a) > 1
        assert not words
    assert multi > 100  # words of several tokens exist, so grouping is really tested


@pytest.fixture(scope="module")
def pd_records_80():
    from llmtrain.corpus.peoples_daily import records

    return list(records(limit=80))


@pytest.mark.parametrize("strategy", ["whole_word", "ngram", "entity"])
def test_whole_words_are_masked_whole(strategy, tiny_corpus, gold_lexicon):
    """With word units, every gold word (flag-delimited) is fully selected or not at all; the token
    strategy splits some, so the check can fail."""
    split = {}
    for strat in (strategy, "token"):
        data = mlm(tiny_corpus, **masking_for(strat, gold_lexicon))
        split[strat] = masked_words = 0
        for _ in range(6):
            for mb in data.next_step():
                _, flags = data.train.get_many(mb["sample_ids"], side="wbd")
                sel = mb["loss_mask"].astype(bool)
                maskable = data.masker.maskable(mb["labels"])
                for i in range(len(sel)):
                    for a, b in units_of(flags[i, :data.seq_len], maskable[i]):
                        part = sel[i, a:b][maskable[i, a:b]]
                        if part.any() and not part.all():
                            split[strat] += 1
                        masked_words += (b - a > 1) and part.all()
        if strat == strategy:
            assert masked_words > 20
    assert split[strategy] == 0
    assert split["token"] > 0


def test_ngram_units_span_at_most_max_ngram_words(tiny_corpus):
    data = mlm(tiny_corpus, strategy="ngram", max_ngram=3)
    seen = np.zeros(4, int)
    for _ in range(4):
        ids = data.sampler.rank_ids(data.consumed_samples).ravel()
        data.consumed_samples += data.global_batch_size
        tokens, flags = data.train.get_many(ids, side="wbd")
        tokens, flags = tokens[:, :128], flags[:, :128]
        maskable = data.masker.maskable(tokens)
        starts = data.masker.unit_starts(tokens, ids, flags, maskable, 0)
        for i in range(len(ids)):
            words = units_of(flags[i], maskable[i])
            word_starts = np.array([a for a, _ in words])
            bounds = list(np.nonzero(starts[i])[0]) + [128]
            for a, b in zip(bounds[:-1], bounds[1:]):
                n_words = int(((word_starts >= a) & (word_starts < b)).sum())
                assert 1 <= n_words <= 3 and (a in word_starts)
                seen[n_words] += maskable[i, a]
    assert seen[1] > seen[2] > seen[3] > 0  # P(n) ~ 1/n


def test_entities_of_the_lexicon_are_masked_as_one_unit(tiny_corpus, gold_lexicon):
    data = mlm(tiny_corpus, strategy="entity", entity_source="lexicon", lexicon=gold_lexicon)
    lex = data.masker.lexicon
    assert lex.n_spans > 100
    whole = partial = 0
    for _ in range(8):
        for mb in data.next_step():
            tokens = mb["labels"]
            _, flags = data.train.get_many(mb["sample_ids"], side="wbd")
            maskable = data.masker.maskable(tokens)
            starts = data.masker.unit_starts(tokens, mb["sample_ids"], flags[:, :128], maskable, 0)
            sel = mb["loss_mask"].astype(bool)
            for r, a, n in lex.match(tokens, units_starts_words(flags[:, :128], maskable), maskable):
                assert not starts[r, a + 1:a + n].any()  # one unit
                if sel[r, a:a + n].all():
                    whole += 1
                partial += sel[r, a:a + n].any() and not sel[r, a:a + n].all()
    assert partial == 0 and whole >= 5


def units_starts_words(flags, maskable):
    starts = flags.astype(bool).copy()
    starts[:, 0] = True
    starts |= ~maskable
    starts[:, 1:] |= ~maskable[:, :-1]
    return starts


def test_jieba_entity_source_loads_the_dictionary_names(tiny_corpus):
    from llmtrain.data.lexicon import jieba_entries

    names = jieba_entries(["nr", "ns", "nt"])
    assert len(names) > 50_000 and "北京" in names and "毛泽东" in names
    data = mlm(tiny_corpus, G=8, m=8, strategy="entity")  # entity_source=jieba by default
    assert data.masker.lexicon.n_spans > 10_000
    (mb,) = data.next_step()
    assert abs(mb["loss_mask"].sum() / data.masker.maskable(mb["labels"]).sum() - 0.15) <= 0.01


def test_masks_depend_only_on_seed_and_sample_id(tiny_corpus):
    """dp1 x micro 4, dp2 x micro 2 (both ranks), a resumed loader: the same masks for each sample id."""
    def by_sample(datas, steps):
        out = {}
        for d in datas:
            for _ in range(steps):
                for mb in d.next_step():
                    for i, sid in enumerate(mb["sample_ids"]):
                        out[int(sid)] = (mb["input_ids"][i].tobytes(), mb["loss_mask"][i].tobytes())
        return out

    one = by_sample([mlm(tiny_corpus, G=16, m=4)], 3)
    two = by_sample([mlm(tiny_corpus, G=16, m=2, rank=r, world=2) for r in (0, 1)], 3)
    assert sorted(one) == list(range(48)) and one == two
    resumed = mlm(tiny_corpus, G=16, m=8)
    resumed.load_state_dict({"consumed_samples": 16})
    assert by_sample([resumed], 2) == {k: v for k, v in one.items() if k >= 16}
    other_seed = by_sample([mlm(tiny_corpus, G=16, m=4, seed=7)], 1)
    assert sum(other_seed[k][1] != one[k][1] for k in other_seed) >= 14
    valid = mlm(tiny_corpus).valid_batches(2, 4)
    assert all(v["loss_mask"].sum() > 0 for v in valid)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_special_tokens_and_padding_are_never_masked(strategy, tiny_corpus, gold_lexicon):
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    data = mlm(tiny_corpus, **masking_for(strategy, gold_lexicon))
    masker = data.masker
    rng = np.random.default_rng(0)
    specials = [tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.eod_id]
    tokens = rng.integers(6, tok.sp_vocab_size, (16, 128))
    tokens[rng.random(tokens.shape) < 0.3] = rng.choice(specials, size=1)[0]
    tokens[:, 100:] = tok.pad_id  # padded tails
    tokens[3, 50:60] = tok.vocab_size - 1  # a vocabulary padding row (never produced by the tokenizer)
    flags = (rng.random(tokens.shape) < 0.6).astype(np.uint8)
    out = masker(tokens, np.arange(16), flags)
    sel = out.loss_mask.astype(bool)
    special = np.isin(tokens, specials) | (tokens >= tok.sp_vocab_size)
    assert sel.sum() > 100 and not (sel & special).any()
    assert np.array_equal(out.input_ids[special], tokens[special])
    replaced = sel & (out.input_ids != tokens) & (out.input_ids != tok.mask_id)
    assert replaced.sum() > 10 and not np.isin(out.input_ids[replaced], specials).any()
    assert (out.input_ids[replaced] < tok.sp_vocab_size).all()
    # in real batches the document separators stay and bear no loss
    batches = [mb for _ in range(4) for mb in data.next_step()]
    labels, inputs, loss_mask = (np.concatenate([mb[k] for mb in batches])
                                 for k in ("labels", "input_ids", "loss_mask"))
    eod = labels == tok.eod_id
    assert eod.sum() >= 3 and not loss_mask[eod].any() and (inputs[eod] == tok.eod_id).all()


def test_masking_a_512_batch_is_fast(tiny_corpus):
    """A vectorised masker: [8, 512] in milliseconds (the benchmark relates it to step time)."""
    data = mlm(tiny_corpus, G=8, m=8, seq_len=512)
    ids = np.arange(8)
    tokens, flags = data.train.get_many(ids, side="wbd")
    data.masker(tokens[:, :512], ids, flags[:, :512])
    t0 = time.perf_counter()
    for _ in range(20):
        data.masker(tokens[:, :512], ids, flags[:, :512])
    assert (time.perf_counter() - t0) / 20 < 0.02


def test_configuration_errors_name_the_field(tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match=r"data.masking.strategy='span'"):
        mlm(tiny_corpus, strategy="span")
    with pytest.raises(ValueError, match=r"data.masking.prob=1.5"):
        mlm(tiny_corpus, prob=1.5)
    with pytest.raises(ValueError, match=r"mask_token_prob \+ random_token_prob = 0.9 \+ 0.2 > 1"):
        mlm(tiny_corpus, mask_token_prob=0.9, random_token_prob=0.2)
    with pytest.raises(ValueError, match="needs data.masking.lexicon"):
        mlm(tiny_corpus, strategy="entity", entity_source="lexicon")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        mlm(tiny_corpus, strategy="entity", entity_source="both", lexicon=str(tmp_path / "nope.txt"))
    # data without the word side file: whole-word masking says how to make it; token masking works
    bare = str(tmp_path / "bare")
    for ext in (".bin", ".idx", ".meta.json"):
        os.symlink(tiny_corpus["prefix"] + ext, bare + ext)
    with pytest.raises(FileNotFoundError, match=r"bare.wbd does not exist.*--word-boundaries jieba"):
        MLMData(data_cfg({**tiny_corpus, "prefix": bare}), 1, 8, 8)
    assert MLMData(data_cfg({**tiny_corpus, "prefix": bare}, strategy="token"), 1, 8, 8).next_step()


def test_encoder_presets_default_to_whole_word_masking():
    from llmtest import compose

    cfg = compose(["model=ernie-tiny"])
    assert cfg.model.family == "encoder" and cfg.data.masking.strategy == "whole_word"
    assert cfg.data.masking.prob == 0.15 and MaskingConfig().mask_token_prob == 0.8
    assert compose(["model=gpt-tiny"]).model.family == "decoder"
    entity = compose(["model=ernie-tiny", "data=pd1998-entity"]).data
    assert (entity.masking.strategy, entity.masking.entity_source) == ("entity", "both")
    assert entity.masking.lexicon == "work/pd1998/entities.txt" and entity.masking.entity_tags == ["nr", "ns", "nt"]
