"""Sites of two implementations paired by name (analysis/site_names.py), the --mapping file
(compare/mapping_file.py), and the baseline compare of the paired sub-layers and operators
(a fused projection against the concatenation of its split parts) on files written by the
real DumpWriter."""

from __future__ import annotations

import numpy as np
import pytest

from srdd_dump.analysis.site_names import (
    BY_ALIAS,
    BY_FUSION,
    BY_MAPPING,
    BY_NAME,
    SiteRule,
    canonical,
    pair_sites,
)
from srdd_dump.analysis.verdicts import FAIL, PASS
from srdd_dump.compare import compare_baseline
from srdd_dump.compare.mapping_file import read_mapping
from srdd_dump.errors import UserError
from srdd_dump.format.writer import DumpWriter, Round, Tensor

from capture_utils import run_cli

pytestmark = pytest.mark.unit

HF = {0: "model.layers.2.self_attn.q_proj", 1: "model.layers.2.self_attn.k_proj",
      2: "model.layers.2.self_attn.v_proj", 3: "model.layers.2.self_attn.o_proj",
      4: "model.layers.2.mlp.gate_proj", 5: "model.layers.2.mlp.up_proj",
      6: "model.layers.2.mlp.down_proj", 7: "model.layers.2.self_attn"}
VLLM = {10: "model.layers.2.self_attn.qkv_proj", 11: "model.layers.2.self_attn.o_proj",
        12: "model.layers.2.mlp.gate_up_proj", 13: "model.layers.2.mlp.down_proj",
        14: "model.layers.2.self_attn", 15: "model.layers.2.self_attn.rotary_emb"}


def by_how(pairing):
    return {(p.mine, p.golden): p.how for p in pairing.pairs}


def test_fused_projections_pair_with_their_split_parts_in_output_order():
    pairing = pair_sites(VLLM, HF, "model.layers.2", "model.layers.2")
    found = by_how(pairing)
    assert found[((10,), (0, 1, 2))] == BY_FUSION  # qkv_proj = [q, k, v]
    assert found[((12,), (4, 5))] == BY_FUSION  # gate_up_proj = [gate, up]
    assert found[((11,), (3,))] == BY_NAME and found[((14,), (7,))] == BY_NAME
    assert pairing.my_unmatched == [15] and pairing.golden_unmatched == []
    # the other way round: the golden side is the fused one
    back = by_how(pair_sites(HF, VLLM, "model.layers.2", "model.layers.2"))
    assert back[((0, 1, 2), (10,))] == BY_FUSION and back[((4, 5), (12,))] == BY_FUSION


def test_other_names_of_one_site_pair_by_alias_across_block_paths():
    meta = {0: "layers.2.attention.wo", 1: "layers.2.feed_forward.w2",
            2: "layers.2.attention_norm", 3: "layers.2.attention.wq"}
    hf = {5: "model.layers.2.self_attn.o_proj", 6: "model.layers.2.mlp.down_proj",
          7: "model.layers.2.input_layernorm", 8: "model.layers.2.mlp.act_fn"}
    pairing = pair_sites(meta, hf, "layers.2", "model.layers.2")
    assert by_how(pairing) == {((0,), (5,)): BY_ALIAS, ((1,), (6,)): BY_ALIAS,
                               ((2,), (7,)): BY_ALIAS}
    assert pairing.my_unmatched == [3] and pairing.golden_unmatched == [8]
    assert canonical("attention.dense") == "attn.o_proj"  # GPT-NeoX: by its container
    assert canonical("mlp.c_proj") == "mlp.down_proj" and canonical("attn.c_proj") == "attn.o_proj"


def test_mapping_rules_come_first_and_take_lists_or_full_names():
    mine = {0: "blocks.2.attn.wqkv", 1: "blocks.2.ffn.w13", 2: "blocks.2.ffn.w2"}
    hf = {5: "model.layers.2.self_attn.q_proj", 6: "model.layers.2.self_attn.k_proj",
          7: "model.layers.2.self_attn.v_proj", 8: "model.layers.2.mlp.gate_up_proj",
          9: "model.layers.2.mlp.down_proj"}
    rules = (SiteRule(("attn.wqkv",), ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj")),
             SiteRule(("blocks.2.ffn.w13",), ("model.layers.2.mlp.gate_up_proj",)))
    pairing = pair_sites(mine, hf, "blocks.2", "model.layers.2", rules)
    assert by_how(pairing) == {((0,), (5, 6, 7)): BY_MAPPING, ((1,), (8,)): BY_MAPPING,
                               ((2,), (9,)): BY_ALIAS}
    assert not pairing.my_unmatched and not pairing.golden_unmatched


def test_a_mapping_file_reads_names_lists_and_sums(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text("# my site: golden site(s)\nsites:\n"
                    "  attention.wqkv: [self_attn.q_proj, self_attn.k_proj, self_attn.v_proj]\n"
                    "  mlp.w13: mlp.gate_proj + mlp.up_proj   # fused gate|up\n"
                    "  'mlp.w2': \"mlp.down_proj\"\n"
                    "  attention.wo:\n    - self_attn.o_proj\n")
    assert read_mapping(str(path)) == (
        SiteRule(("attention.wqkv",), ("self_attn.q_proj", "self_attn.k_proj",
                                       "self_attn.v_proj")),
        SiteRule(("mlp.w13",), ("mlp.gate_proj", "mlp.up_proj")),
        SiteRule(("mlp.w2",), ("mlp.down_proj",)),
        SiteRule(("attention.wo",), ("self_attn.o_proj",)))


@pytest.mark.parametrize("text, words", [
    ("sites: [a, b", "an unclosed list"),
    ("", "expected a 'sites:' table"),
    ("- a\n- b\n", "a list item outside an entry"),
    ("sites:\n  a.b: 3\n", "'3' is not a module name"),
    ("sites:\n  a.b: [x, 2]\n", "'2' is not a module name"),
    ("sites:\n  a.b:\n", "'a.b' names no golden site"),
    ("sites:\n  a.b: c\nother: d\n", "'other' is not part of the 'sites:' table"),
    ("sites:\n  !!python/object:os.system x: y\n", "is not a module name"),
    ("sites:\n  a.b:\n    - c + d\n", "a list item is one name"),
])
def test_a_bad_mapping_file_is_one_line(tmp_path, text, words):
    path = tmp_path / "map.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        read_mapping(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="cannot read it"):
        read_mapping(str(tmp_path / "missing.yaml"))


# -- the compare of fused against split sites, on written files ---------------------------


def write_sites(path: str, sites: dict[str, np.ndarray], block: np.ndarray) -> str:
    """One prefill round of one block (model.layers.0) with the given site outputs."""
    names = list(sites)
    writer = DumpWriter(path, {"rank": 0, "pid": 1, "sites": names,
                               "site_roles": ["linear"] * len(names)},
                        ["model.layers.0"], names)
    batch, ntok, _ = block.shape
    tensors = [Tensor(0, block.astype(np.float32), "float32")]
    tensors += [Tensor(0, x.astype(np.float32), "float32", site=k)
                for k, x in enumerate(sites.values())]
    writer.submit(Round(sample=0, step=0, batch=batch, seq=ntok, positions=np.arange(ntok),
                        token_ids=np.arange(batch * ntok).reshape(batch, ntok),
                        tensors=tensors))
    return writer.close()


@pytest.fixture
def split_and_fused(tmp_path):
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 5, w)) for w in (16, 8, 8))
    block = rng.standard_normal((1, 5, 16))
    golden = write_sites(str(tmp_path / "hf" / "a.h5"), {
        "model.layers.0.self_attn.q_proj": q, "model.layers.0.self_attn.k_proj": k,
        "model.layers.0.self_attn.v_proj": v}, block)
    return tmp_path, golden, (q, k, v), block


def fused_row(result):
    rows = result.sites[result.sites["matched_by"] == BY_FUSION]
    assert len(rows) == 1, result.sites
    return rows.iloc[0]


def test_a_fused_site_is_compared_with_the_concatenation_of_its_parts(split_and_fused):
    tmp_path, golden, (q, k, v), block = split_and_fused
    mine = write_sites(str(tmp_path / "vllm" / "a.h5"), {
        "model.layers.0.self_attn.qkv_proj": np.concatenate([q, k, v], axis=-1)}, block)
    row = fused_row(compare_baseline(mine, golden))
    assert row["verdict"] == PASS and row["relative_euclidean_distance"] == 0
    assert row["golden_module"] == ("model.layers.0.self_attn.q_proj + model.layers.0."
                                    "self_attn.k_proj + model.layers.0.self_attn.v_proj")
    assert row["golden_shape"] == row["my_shape"] == "[1, 5, 32]"


def test_an_error_in_one_part_of_a_fused_site_fails_it(split_and_fused):
    tmp_path, golden, (q, k, v), block = split_and_fused
    wrong_k = k + 0.5  # a wrong K part, e.g. a misplaced head
    mine = write_sites(str(tmp_path / "vllm" / "a.h5"), {
        "model.layers.0.self_attn.qkv_proj": np.concatenate([q, wrong_k, v], axis=-1)}, block)
    assert fused_row(compare_baseline(mine, golden))["verdict"] == FAIL
    # the parts in the wrong order are not the fused output either
    swapped = write_sites(str(tmp_path / "swapped" / "a.h5"), {
        "model.layers.0.self_attn.qkv_proj": np.concatenate([k, q, v], axis=-1)}, block)
    assert fused_row(compare_baseline(swapped, golden))["verdict"] == FAIL


def test_the_cli_mapping_option_pairs_what_names_cannot(split_and_fused):
    tmp_path, golden, (q, k, v), block = split_and_fused
    mine = write_sites(str(tmp_path / "meta" / "a.h5"), {
        "model.layers.0.attention.wqkv": np.concatenate([q, k, v], axis=-1)}, block)
    out = str(tmp_path / "report.csv")
    plain = run_cli("srdd-compare", mine, "--baseline", golden, "-o", out)
    assert plain.returncode == 0, plain.stderr
    assert "unmatched: my site model.layers.N.attention.wqkv" in plain.stdout
    mapping = tmp_path / "map.yaml"
    mapping.write_text("sites:\n  attention.wqkv: self_attn.q_proj + self_attn.k_proj + "
                       "self_attn.v_proj\n")
    mapped = run_cli("srdd-compare", mine, "--baseline", golden, "--mapping", str(mapping),
                     "-o", out)
    assert mapped.returncode == 0, mapped.stderr
    assert "1 by mapping" in mapped.stdout and "unmatched" not in mapped.stdout
    assert "paired no sites" not in mapped.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("sites:\n  attention.wqvk: [self_attn.q_proj, self_attn.k_proj]\n")
    noted = run_cli("srdd-compare", mine, "--baseline", golden, "--mapping", str(typo),
                    "-o", out)
    assert noted.returncode == 0 and "'attention.wqvk: self_attn.q_proj + self_attn.k_proj' " \
        "paired no sites" in noted.stderr, noted.stderr
    bad = run_cli("srdd-compare", mine, "--mapping", str(mapping), "-o", out)
    assert bad.returncode != 0 and "apply with --baseline only" in bad.stderr
    assert "Traceback" not in bad.stderr
