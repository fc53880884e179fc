"""What `pipeline cache-info` prints: the cache's identity, completeness and provenance, or --json's document."""

from __future__ import annotations

from rich.markup import escape

from pipeline.ui import console, key_value_table, print_json


def show_cache_info(info: dict, json_out: bool) -> None:
    if json_out:
        print_json(info)
        return
    done, counts, size, read = info["completeness"], info["counts"], info["bytes"], info["read"]
    prov = info["provenance"]

    def groups(grouped: dict) -> str:
        return "; ".join(f"{value}: {g['shards']} shards" for value, g in grouped.items()) or "none"

    def share(value) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    rows = [("cache", info["cache"]), ("schema", info["schema_version"]), ("created", info["created"]),
            ("shards committed / planned", f"{done['committed']} / {done['planned']}"
             + ("" if done["complete"] else f" (INCOMPLETE: {len(done['missing'])} missing, {done['missing_rows']} rows)")),
            ("uncommitted (record does not match files)", ", ".join(done["broken"]) or "none"),
            ("shards of another identity", "; ".join(f"{k}: {', '.join(v)}" for k, v in done["other_identity"].items())
             or "none"),
            ("kernel path", groups(prov["kernel_path"]))]
    rows += [(f"  {op}", groups(kinds)) for op, kinds in prov["ops"].items()]
    rows += [("hosts", groups(prov["hosts"])), ("environments", groups(prov["environments"])),
             ("layouts", groups(prov["layouts"])),
             ("rows / samples", f"{counts['rows']:,} / {counts['samples']:,}"),
             ("tokens / supervised", f"{counts['tokens']:,} / {counts['supervised_tokens']:,} ({share(counts['supervised_share'])})"),
             ("reasoning / tool-call share of supervised", f"{share(counts['reasoning_share'])} / {share(counts['tool_call_share'])}"),
             ("truncated / skipped overlong / malformed / no supervised token",
              f"{counts['truncated']} / {counts['overlong_skipped']} / {counts['malformed']} / {counts['no_supervised_tokens']}"),
             ("stored bytes / files", f"{size['stored']:,} / {size['files']:,}"),
             ("bytes per token (stored / raw)", "n/a" if size["per_token"] is None else
              f"{size['per_token']:,.1f} / {size['raw_per_token']:,.1f} ({size['stored_vs_raw']:.3f})"),
             ("read", f"{read['records']} shard records in {read['seconds']:.2f} s"
              + ("" if read["requests"] is None else f", {read['requests']} requests"))]
    if info.get("draft_vocab"):
        dv = info["draft_vocab"]
        rows.append(("supervised labels (distinct)", f"{dv['labels']:,} ({dv['distinct']:,} of {dv['target_vocab']:,} ids; "
                                                     f"first {dv['max_length']:,} tokens of each sample: train's "
                                                     f"max_length, from {dv['max_length_from']})"))
        rows += [(f"draft vocabulary {r['size']:,}: coverage", f"{r['coverage']:.2%} (reserved {r['reserved']}, byte "
                                                               f"fallbacks {r['byte_fallbacks']})") for r in dv["rows"]]
    if info.get("energy"):
        e = info["energy"]
        rows += [(f"top {r['rank']:,} of {e['width']:,} components: energy kept",
                  f"{r['energy']:.2%} (pilot: first {e['pilot_tokens']:,} tokens)") for r in e["rows"]]
    console.print(key_value_table("cache-info", [(k, escape(str(v))) for k, v in rows]))
    identity = info["identity"]
    console.print(key_value_table("identity", [(f"{section}.{k}", escape(str(v))) for section in ("target", "tokenizer", "capture", "data")
                                               for k, v in identity[section].items()]))

