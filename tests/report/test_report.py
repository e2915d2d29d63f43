"""The report on the shipped results fixture (synthetic numbers): loading, the tables' numbers and paper
columns, skipped tables, figures written, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_eval.report import build_tables, load_results, to_latex, to_markdown, write_report
from sparse_eval.report.__main__ import main as report_main
from sparse_eval.report.paper import lookup

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results" / "runs"


@pytest.fixture(scope="module")
def df():
    return load_results(FIXTURE)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, write_report(FIXTURE, out)


def _summaries(task: str):
    for p in sorted((FIXTURE / task).rglob("summary.json")):
        yield p.parent, json.loads(p.read_text())


def test_collected_table_and_runs_folder_agree(df, tmp_path):
    from sparse_eval.results.collect import collect, write_table

    paths = write_table(collect(FIXTURE), tmp_path / "results")
    for p in paths:  # CSV, and parquet where pyarrow is installed
        other = load_results(p)
        assert len(other) == len(df)
        a = df.sort_values("run_dir").reset_index(drop=True)
        b = other.sort_values("run_dir").reset_index(drop=True)
        assert list(a["config"]) == list(b["config"])
        assert (a["score"] - b["score"]).abs().max() < 1e-9
    assert load_results(tmp_path / "results.csv")["method_name"].notna().all()


def test_ruler_table_has_the_fixture_numbers_and_paper_diffs(df):
    tables = {t.name: t for t in build_tables(df)[0]}
    t3 = tables["magicpig_table3_ruler"]
    frame = t3.frame()
    md = to_markdown(t3)
    checked = 0
    for run, s in _summaries("ruler"):
        m = s["method_config"]
        if (
            s["model"] != "llama3_1_8b_instruct"
            or m["name"] != "magicpig"
            or (m["K"], m["L"]) != (10, 150)
            or not m["center"]
        ):
            continue
        col = {16384: "16K", 32768: "32K"}[s["task_config"]["length"]]
        row = frame[(frame["Method"] == "MagicPIG") & (frame["Config"] == "(10,150)")].iloc[0]
        assert row[col] == pytest.approx(s["score"])  # the run's own aggregate
        paper = lookup(
            "MagicPIG Table 3",
            "llama3_1_8b_instruct",
            "magicpig",
            {"K": 10, "L": 150, "center": True, "min_collisions": 2, "mips": False},
        ).values[col]
        assert row[f"{col}_paper"] == paper
        assert row[f"{col}_diff"] == pytest.approx(s["score"] - paper)
        assert f"{s['score']:.1f} ({paper:.1f}, {s['score'] - paper:+.1f})" in md
        checked += 1
    assert checked == 2
    # no centering is not the paper's MagicPIG: no paper column for it
    nc = frame[frame["Config"] == "(10,150) no centering"].iloc[0]
    assert nc["16K_paper"] is None or nc["16K_paper"] != nc["16K_paper"]
    # Avg is compared only when the row has every length the paper averaged (we have 16K and 32K only)
    assert "Avg_paper" not in frame or all(v is None or v != v for v in frame["Avg_paper"])
    assert "\\begin{tabular}" in to_latex(t3) and "\\toprule" in to_latex(t3)


def test_costs_and_other_tables(df):
    tables, skipped = build_tables(df)
    names = {t.name for t in tables}
    assert {
        "magicpig_table1_lm_eval",
        "magicpig_table2_longbench",
        "magicpig_table5_ruler_70b",
        "magicpig_table9_cost_by_KL",
        "magicpig_table12_equal_cost",
        "magicpig_table13_L120",
        "ds_table2_ppl_by_sparsity",
        "ds_table3_channel_types",
    } <= names
    t1 = next(t for t in tables if t.name == "magicpig_table1_lm_eval").frame()
    for run, s in _summaries("lm_eval"):
        recs = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        gsm = next(r for r in recs if r["id"].startswith("gsm8k"))
        label = "MagicPIG" if s["method"] == "magicpig" else "Full"
        row = t1[t1["Method"] == label].iloc[0]
        assert row["GSM"] == pytest.approx(100 * gsm["score"])  # lm-eval fractions shown as %
        assert row["Cost_total"] == pytest.approx(row["Cost1"] + row["Cost2"])
        assert row["Cost2"] == pytest.approx(sum(r["cost2"] for r in recs) / len(recs))
    ds2 = next(t for t in tables if t.name == "ds_table2_ppl_by_sparsity").frame()
    qk = ds2[(ds2["Variant"] == "DS") & (ds2["Channels"] == "qk") & (ds2["Channel sparsity"] == "= token")].iloc[0]
    assert qk["1/16_paper"] == 5.76 and qk["1/16_diff"] == pytest.approx(qk["1/16"] - 5.76)


def test_table1_marks_incomplete_only_the_lm_eval_task_cut_short():
    from sparse_eval.report.tables import magicpig_table1

    d = load_results(FIXTURE / "lm_eval")  # complete runs of three lm-eval tasks each, one record per task
    assert not any("incomplete" in str(r["Config"]) for r in magicpig_table1(d).rows)
    d.loc[(d["method"] == "magicpig") & (d["subtask"] == "mmlu_flan_cot_fewshot_local"), "samples"] = 0
    rows = {r["Method"]: r["Config"] for r in magicpig_table1(d).rows}
    assert rows == {"Full": "–", "MagicPIG": "(10,220) (incomplete: MMLU 0/1)"}


def test_table2_marks_incomplete_only_the_dataset_cut_short():
    from sparse_eval.report.tables import magicpig_table2

    d = load_results(FIXTURE / "longbench")  # complete runs of six datasets, 2 samples each
    assert not any("incomplete" in str(r["Config"]) for r in magicpig_table2(d).rows)  # were "12/72"
    d.loc[(d["method"] == "quest") & (d["subtask"] == "trec"), "samples"] = 1
    assert [r["Config"] for r in magicpig_table2(d).rows if r["Method"] == "Quest"] == [
        "(16,0.05) (incomplete: TrC 1/2)"
    ]


def test_tables_without_data_are_skipped_with_a_reason(df):
    tables, skipped = build_tables(df[df["task"] == "wikitext"])
    assert {t.name for t in tables} == {"score_intervals", "ds_table2_ppl_by_sparsity", "ds_table3_channel_types"}
    assert "ruler" in skipped["magicpig_table3"] and "lm_eval" in skipped["magicpig_table1"]


def test_report_files_and_figures(report):
    out, res = report
    assert (out / "report.md").read_text().count("### ") == len(res["tables"])
    for t in res["tables"]:
        for suffix in (".md", ".tex", ".csv"):
            assert (out / "tables" / f"{t.name}{suffix}").stat().st_size > 0
    pngs = {p.name for p in res["figures"] if p.suffix == ".png"}
    assert {
        "fig1_topk_retrieval_vs_aggregation.png",
        "fig6c_oracle_vs_topk.png",
        "fig9a_centering.png",
        "fig9bc_magicpig_vs_topk.png",
        "ds_fig4_retrieval.png",
        "ds_fig1_ppl_sparsity.png",
        "ds_fig9_ppl_grid.png",
        "pareto_ruler_llama3_1_8b_instruct.png",
    } <= pngs
    for p in res["figures"]:
        assert p.stat().st_size > 5_000, p
    # the fixture has no RULER run of one needle subtask alone (DS Fig. 4's variant: test_ds_fig4_niah_variant)
    assert set(res["skipped_figures"]) == {"ds_fig4_niah"}
    # the table over the subtasks full attention solves is made only from rows collect makes on request
    assert res["skipped_tables"] == {
        "scores_where_full_solves": "no rows over the subtasks full attention solves (collect with --full-at-least "
        "X makes them)"
    }


def test_ds_fig4_niah_variant(df, tmp_path):
    """DS Fig. 4's variant draws RULER runs of one single-needle subtask alone, and nothing else."""
    from sparse_eval.report.figures import ds_fig4_niah
    from sparse_eval.report.tables import Skip

    with pytest.raises(Skip, match="niah_single_2"):  # the fixture's RULER runs have many subtasks each
        ds_fig4_niah(df, tmp_path)
    one = df[df["task"] == "kv_retrieval"].assign(task="ruler", subtask="niah_single_2")
    paths = ds_fig4_niah(one, tmp_path)
    assert {p.name for p in paths} == {"ds_fig4_niah.png", "ds_fig4_niah.pdf"}
    assert all(p.stat().st_size > 5_000 for p in paths)
    two = one.copy()
    two.loc[two.index[0], "subtask"] = "niah_single_1"
    with pytest.raises(Skip, match="one figure is one subtask"):
        ds_fig4_niah(two, tmp_path)


def test_cli(tmp_path, capsys):
    from sparse_eval.results.collect import collect, write_table

    write_table(collect(FIXTURE / "lm_eval"), tmp_path / "results")
    assert report_main([str(tmp_path / "results.csv"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "magicpig_table1_lm_eval" in out and "skipped table magicpig_table3" in out
    assert (tmp_path / "rep" / "tables" / "magicpig_table1_lm_eval.md").exists()
    assert report_main([str(tmp_path / "missing.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cost_tables_take_the_ruler_length_present(df):
    """Tables 12 / 13 are RULER 16K in the paper: with 16K data they show it beside the paper; with only other
    lengths they show those, say so in the title and put no paper number beside them."""
    from sparse_eval.report.tables import magicpig_table12, magicpig_table13

    t12 = magicpig_table12(df)
    assert "(RULER 16K)" in t12.title and {r["Length"] for r in t12.rows} == {"16K"}
    f = t12.frame()
    row = f[f["Config"] == "(9,120)"].iloc[0]
    assert row["Score_paper"] == 92.8 and row["Score_diff"] == pytest.approx(row["Score"] - 92.8)
    short = df.copy()
    is_ruler = short["task"] == "ruler"
    short.loc[is_ruler & (short["length"] == 16384), "length"] = 2048
    short = short[~is_ruler | (short["length"] == 2048)]
    for fn in (magicpig_table12, magicpig_table13):
        t = fn(short)
        assert "here: RULER 2K" in t.title and "16K" in t.title and not any(t.paper_source)
        assert {r["Length"] for r in t.rows} == {"2K"}
        assert "Score_paper" not in t.frame()
    # the score is the mean of the runs' own aggregates at that length
    runs = short[(short["task"] == "ruler") & (short["method"] == "magicpig") & (short["subtask"] == "all")]
    want = runs[runs["config"] == "(9,120)"]["score"].mean()
    got = next(r for r in magicpig_table12(short).rows if r["Config"] == "(9,120)")
    assert got["Score"] == pytest.approx(want)


def test_table5_skip_names_the_70b_model(df):
    tables, skipped = build_tables(df[df["model"] != "llama3_1_70b_instruct"])
    assert "llama3_1_70b_instruct" in skipped["magicpig_table5"]
    assert "llama3_1_8b_instruct" in skipped["magicpig_table5"]  # the ruler runs that exist are named


def test_ds_table3_random_column_is_the_mean_over_seeds(df):
    import pandas as pd

    from sparse_eval.report.tables import ds_table3

    qk = df[
        (df["method"] == "double_sparsity")
        & (df["method.channel_type"] == "qk")
        & (df["model"] == "llama2_7b")
        & (df["method.beta"].astype(float) == 128)
        & (df["method.alpha"].astype(float) == 0.25)
        & (df["method.offload"].astype(str).str.lower() == "false")
    ]
    assert len(qk) == 1
    extra = pd.concat([qk] * 2, ignore_index=True)
    extra["method.channel_type"] = "random"
    extra["method.seed"] = [0, 1]
    extra["score"] = [8.0, 9.0]
    t = ds_table3(pd.concat([df, extra], ignore_index=True))
    row = next(r for r in t.rows if r["Model"] == "llama2_7b")
    assert row["random"] == pytest.approx(8.5) and row["qk"] == pytest.approx(float(qk["score"].iloc[0]))
    assert t.value_cols == ["Original", "random", "q", "k", "qk"]
    assert "llama2_7b: mean over 2 seed(s) (0, 1)" in t.caption
    assert t.frame().set_index("Model").loc["llama2_7b", "random_paper"] == 8.62


def test_several_inputs_are_reported_together(df, tmp_path):
    from sparse_eval.results.collect import collect, write_table

    a = write_table(collect(FIXTURE / "lm_eval"), tmp_path / "a")[0]
    b = write_table(collect(FIXTURE / "wikitext"), tmp_path / "b")[0]
    both = load_results([a, b])
    assert len(both) == len(load_results(a)) + len(load_results(b))
    assert set(both["task"]) == {"lm_eval", "wikitext"}
    assert report_main([str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    names = {p.stem for p in (tmp_path / "rep" / "tables").glob("*.md")}
    assert {"magicpig_table1_lm_eval", "ds_table2_ppl_by_sparsity", "ds_table3_channel_types"} <= names
    assert str(a) in (tmp_path / "rep" / "report.md").read_text().splitlines()[0]


def test_fig9_grid_uses_the_qk_channels_only(df, tmp_path, monkeypatch):
    """DS Fig. 9's grid is of qk channels (the paper's): other channel types at the same level stay out of it."""
    import pandas as pd

    from sparse_eval.report import figures
    from sparse_eval.report.figures import ds as ds_figures

    ds = df[(df["task"] == "wikitext") & (df["method"] == "double_sparsity")]
    extra = ds[ds["method.channel_type"] == "qk"].head(1).copy()
    extra["method.channel_type"], extra["score"] = "random", 1e4
    seen = []
    real = figures.ppl_grid
    monkeypatch.setattr(ds_figures, "ppl_grid", lambda d: seen.append(d) or real(d))
    paths = figures.ds_fig1_ppl(pd.concat([df, extra], ignore_index=True), tmp_path)
    assert any(p.name == "ds_fig9_ppl_grid.png" for p in paths) and seen
    for d in seen:
        assert set(d["ctype"]) == {"qk"} and not d["offload"].any()
        assert real(d)[2][~pd.isna(real(d)[2])].max() < 1e4


def test_pareto_has_a_panel_per_length_and_per_single_subtask(df, tmp_path, monkeypatch):
    from sparse_eval.report import figures
    from sparse_eval.report.figures import tradeoff

    panels = {}
    real = figures.plotting.panels

    def spy(n, *a, **k):
        panels[len(panels)] = n
        return real(n, *a, **k)

    monkeypatch.setattr(tradeoff, "panels", spy)
    kv = df[df["task"] == "kv_retrieval"]
    figures.pareto(kv, tmp_path)
    assert panels == {0: kv["length"].nunique()}  # 1K, 2K, 4K
    panels.clear()
    lm = df[(df["task"] == "lm_eval") & (df["subtask"] != "all")].copy()  # as runs of one lm-eval task each
    lm["run_dir"] = lm["run_dir"] + "/" + lm["subtask"]
    figures.pareto(lm, tmp_path)
    assert panels == {0: lm["subtask"].nunique()}
    assert (tmp_path / "pareto_lm_eval_llama3_1_8b_instruct.png").stat().st_size > 5_000


def test_writers_escape_and_align():
    """DataFrame.to_markdown / Styler.to_latex: a pipe stays inside its cell, LaTeX specials and the Greek letters
    are escaped, key columns left-aligned and value columns right-aligned, paper cells 'ours (paper, diff)'."""
    from sparse_eval.report.tables import Table

    t = Table(
        "t",
        "Title_1 & more",
        "α = 1/4, 5% of β",
        ["Model", "Config"],
        ["16K", "Avg"],
        [{"Model": "a|b", "Config": "x_y", "16K": 12.34, "Avg": None}],
        paper=[{"16K": 10.0}],
        paper_source=["Table 3"],
    )
    md = to_markdown(t).splitlines()
    assert md[0] == "### Title_1 & more" and "α = 1/4, 5% of β" in md
    head = next(i for i, line in enumerate(md) if line.startswith("| Model"))
    assert [c.strip() for c in md[head].strip("|").split("|")] == ["Model", "Config", "16K", "Avg"]
    assert md[head + 1].replace(" ", "").startswith("|:---") and md[head + 1].rstrip().endswith(":|")
    cells = [c.strip() for c in md[head + 2].strip("|").replace("\\|", "\x00").split("|")]
    assert cells == ["a\x00b", "x_y", "12.3 (10.0, +2.3)", "–"]
    tex = to_latex(t)
    assert r"\caption{Title\_1 \& more. $\alpha$ = 1/4, 5\% of $\beta$ Cells: ours (paper, ours $-$ paper).}" in tex
    assert r"\begin{tabular}{llrr}" in tex and r"\label{tab:t}" in tex
    assert r"a|b & x\_y & 12.3 (10.0, +2.3) & -- \\" in tex
    assert tex.index(r"\toprule") < tex.index(r"\midrule") < tex.index(r"\bottomrule")


def _drawn_figures(monkeypatch, figures):
    """Spy on ``save`` of every figure family: the figures a call would write, kept open for inspection."""
    from sparse_eval.report.figures import ds, magicpig, tradeoff

    seen = []
    for family in (ds, magicpig, tradeoff):
        monkeypatch.setattr(family, "save", lambda fig, out, stem: seen.append((stem, fig)) or [])
    return seen


def test_figures_draw_score_intervals_as_error_bars_when_collected(df, tmp_path, monkeypatch):
    """With collect's score_lo / score_hi each single-run point gets a bar from lo to hi; without them, none."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from sparse_eval.report import figures
    from sparse_eval.report.load import run_rows

    assert df["score_lo"].notna().any()
    seen = _drawn_figures(monkeypatch, figures)
    for name in ("pareto", "fig6c_oracle_vs_topk", "fig9bc_magicpig_vs_topk"):
        figures.FIGURES[name](df, tmp_path)
    bars = {
        stem: [c for fig in [f] for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
        for stem, f in seen
    }
    # the fixture's lm-eval runs have no interval (collect has no per-document terms for them): no bar there
    assert all(bool(v) != stem.startswith("pareto_lm_eval") for stem, v in bars.items()), {
        k: len(v) for k, v in bars.items()
    }
    runs = run_rows(df)
    ends = {(round(lo, 6), round(hi, 6)) for lo, hi in zip(runs["score_lo"], runs["score_hi"]) if lo == lo}
    pareto_bars = [c for stem, cs in bars.items() if stem.startswith("pareto_") for c in cs]
    segs = [seg for c in pareto_bars for seg in c.lines[2][0].get_segments()]
    assert segs and all((round(seg[0][1], 6), round(seg[1][1], 6)) in ends for seg in segs)
    assert any(t.get_text().replace("\n", " ") == figures.INTERVAL_NOTE for _, f in seen for t in f.texts)
    for _, f in seen:
        plt.close(f)
    seen.clear()
    bare = df.drop(columns=["score_lo", "score_hi"])
    for name in ("pareto", "fig6c_oracle_vs_topk", "fig9bc_magicpig_vs_topk"):
        figures.FIGURES[name](bare, tmp_path)
    assert seen and not any(isinstance(c, ErrorbarContainer) for _, f in seen for ax in f.axes for c in ax.containers)
    assert not any(t.get_text().replace("\n", " ") == figures.INTERVAL_NOTE for _, f in seen for t in f.texts)
    for _, f in seen:
        plt.close(f)


def test_score_intervals_table_shows_kv_bytes_in_kib(df):
    from sparse_eval.report.tables import score_intervals

    t = score_intervals(df.assign(kv_bytes=[2048.0 * (i + 1) for i in range(len(df))]))
    assert "KV KiB/row" in t.value_cols
    assert {r["KV KiB/row"] for r in t.rows} <= {2.0 * (i + 1) for i in range(len(df))}
    assert all(r["KV KiB/row"] is None for r in score_intervals(df).rows)  # not recorded: an empty cell


def test_incomplete_runs_are_marked_in_the_paper_tables(df):
    """A run cut short keeps its row (the samples it scored) but says so: n of the expected, and a caption."""
    d = df.copy()
    full = (d["task"] == "ruler") & (d["method"] == "full")
    d.loc[full, "expected_samples"] = d.loc[full, "samples"] * 2
    t3 = {t.name: t for t in build_tables(d)[0]}["magicpig_table3_ruler"]
    configs = list(t3.frame()["Config"])
    assert any("(incomplete: " in c for c in configs) and any(c == "(10,150)" for c in configs)
    assert "Rows marked incomplete" in t3.caption
    t3_ok = {t.name: t for t in build_tables(df)[0]}["magicpig_table3_ruler"]
    assert "Rows marked incomplete" not in t3_ok.caption


def test_labels_see_the_shared_static_key_counts():
    """``sink``/``local`` are columns of their own in collect's table (every method shares them); a method whose
    label is its static keys (StreamingLLM) still reads them, as numbers."""
    from sparse_eval.report.load import config_label

    row = {"method": "streaming_llm", "method_config": "streaming_llm", "sink": 4, "local": 64}
    assert config_label(row) == "4 sink + 64 recent"


def test_lm_eval_panels_count_documents_of_complete_runs_and_find_the_incomplete():
    import pandas as pd

    from sparse_eval.report.figures.plotting import n_text
    from sparse_eval.report.load import cut_short

    d = pd.DataFrame({"task": ["lm_eval"] * 2, "samples": [8, 3], "expected_samples": [8, 8], "pooled_n": [250, 93]})
    assert list(cut_short(d)) == [False, True]  # drawn hollow and left off the Pareto front
    assert n_text(d) == "n = 250 documents per complete point"  # not lm-eval's per-task limit
    assert list(cut_short(d.drop(columns="expected_samples"))) == [False, False]
