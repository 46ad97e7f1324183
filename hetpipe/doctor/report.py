"""The doctor's verdict and tables: the nodes' fact sheets and probe results, read by a person.

Pure functions over the JSON-ready sheets of hetpipe/doctor/facts.py and the
pair results of hetpipe/doctor/probe.py, so every node prints the same
verdict from the same data and tests can feed hand-made sheets. Node 0 (the
first node in the cluster config's group order) is the reference the other
nodes are compared with.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.comm.nics import Nic, check_dialable, socket_ifname
from hetpipe.doctor.config import DoctorSettings
from hetpipe.errors import ConfigError
from hetpipe.process.torch_compat import range_text, torch_release, unsupported_torch


def who(sheet: dict) -> str:
    """How the report names a node: by index, and by its group where the config's node counts tell it."""
    return f"node {sheet['node']} ({sheet['label']})" if sheet.get("label") else f"node {sheet['node']}"


def blockers_of(sheets: dict[int, dict], pairs: list[dict], multi_node: bool) -> list[str]:
    """Everything that stops a job, one line each: each node's own problems,
    differences from node 0 (the reference), undialable or unreachable NICs."""
    out: list[str] = []
    ref = sheets.get(0)
    undialable: set[int] = set()
    for node, sheet in sorted(sheets.items()):
        try:
            check_dialable([n["address"] for n in sheet["nics"]], multi_node, sheet["selection"])
        except ConfigError as exc:
            out.append(f"{who(sheet)}: {exc}")
            undialable.add(node)
        out += [f"{who(sheet)}: {b}" for b in sheet["blockers"]]
        if unsupported_torch(sheet["torch"]) is not None:
            out.append(f"{who(sheet)} runs torch {sheet['torch']} ({sheet['build']} build), outside the releases "
                       f"hetpipe supports ({range_text()}): install one of them on this node")
        if ref is None or node == 0:
            continue
        if sheet["hetpipe"] != ref["hetpipe"]:
            out.append(f"{who(sheet)} runs hetpipe {sheet['hetpipe']}, {who(ref)} runs {ref['hetpipe']}: "
                       "install the same hetpipe on every node")
        if sheet["config"] != ref["config"]:
            out.append(f"{who(sheet)} composed config {sheet['config']}, {who(ref)} {ref['config']}: give every "
                       "node the same command line (only NIC addresses/interfaces and data paths may differ)")
        differing = _differing_data(sheet["data"], ref["data"])
        if differing:
            out.append(f"{who(sheet)} has other data than {who(ref)} ({differing}): put the same corpus on "
                       "every node")
        if None not in (sheet["tokenizer"]["digest"], ref["tokenizer"]["digest"]) and \
                sheet["tokenizer"]["digest"] != ref["tokenizer"]["digest"]:
            out.append(f"{who(sheet)} has another tokenizer than {who(ref)}: put the same tokenizer on every node")
        if sheet["nics"] and ref["nics"] and len(sheet["nics"]) != len(ref["nics"]):
            out.append(f"{who(sheet)} selects {len(sheet['nics'])} NICs, {who(ref)} {len(ref['nics'])}: select "
                       f"the same number on every node ({sheet['selection']})")
    for p in pairs:
        # A pair with an undialable end fails for the reason already given.
        if not p["ok"] and not undialable & {p["src"], p["dst"]}:
            src, dst = sheets[p["src"]], sheets[p["dst"]]
            out.append(f"{who(src)} cannot reach {who(dst)} at {p['endpoint'][0]}:{p['endpoint'][1]} "
                       f"({p['dst_nic']['name']}) from {p['src_nic']['name']} {p['src_nic']['address']}: "
                       f"{p['error']}: check the route and firewall between these NICs")
    return out


def warnings_of(sheets: dict[int, dict], pairs: list[dict]) -> list[str]:
    """What lets a job start but not as configured."""
    return [f"{who(sheets[p['src']])} -> {who(sheets[p['dst']])}: traffic bound to {p['src_nic']['name']} "
            f"{p['src_nic']['address']} left through another interface ({p['src_nic']['name']}'s byte counter "
            "grew less than what was sent): give each NIC's subnet its own route"
            for p in pairs if p["ok"] and p["tx_short"]]


def multi_node_job(cluster: ClusterConfig, sheets: dict[int, dict]) -> bool:
    """Whether the job spans hosts: by config, or because the nodes do not share one network stack."""
    return not cluster.single_node or len({s["network"] for s in sheets.values()}) > 1


# ---------------------------------------------------------------- report

def format_node(sheet: dict) -> str:
    """The table of one node."""
    rows = [("name", "addresses", "state", "speed", "selected")]
    for i in sheet["interfaces"]:
        chosen = [str(j) for j, n in enumerate(sheet["nics"]) if n["name"] == i["name"]]
        rows.append((i["name"], " ".join(i["ipv4"] + i["ipv6"]) or "-", i["state"],
                     f"{i['speed_mbps']} Mb/s" if i["speed_mbps"] else "-",
                     f"stripe {','.join(chosen)}" if chosen else ""))
    nic_lines = _columns(rows)
    if sheet["nics"]:
        chosen = ", ".join(f"{n['name'] or '*'} {n['address']}" for n in sheet["nics"])
        try:
            ifname = f"; GLOO_SOCKET_IFNAME={socket_ifname([Nic(**n) for n in sheet['nics']])}"
        except ConfigError:
            ifname = ""
        selection = f"{sheet['selection']}: {chosen}{ifname}"
    else:
        selection = f"{sheet['selection']}: none (see the blockers)"
    gpus = ", ".join(f"{g['name']} {g['memory_gib']} GiB" for g in sheet["gpus"]) or "none visible"
    data = sheet["data"]
    data_line = "\n".join([data["summary"], *(
        f"{Path(name).name}: sha256 {d['sha256'][:16]} ({d['method']}, {d['bytes']:,} bytes)"
        for name, d in data["files"].items())])
    tok = sheet["tokenizer"]
    tok_line = tok["summary"] + (f": sha256 {tok['digest'][:16]} (all files)" if tok["digest"] not in
                                 (None, "byte") else "")
    lines = [f"hetpipe doctor: {who(sheet)} of {sheet['nodes']}, host {sheet['host']}",
             *_fields([
                 ("hetpipe", f"{sheet['hetpipe']} (Python {sheet['python']})"),
                 ("torch", f"{sheet['torch']}, {sheet['build']} build"),
                 ("GPUs", gpus),
                 ("NICs", "\n".join(nic_lines)),
                 ("selected", selection),
                 ("RDMA", "\n".join(sheet["rdma"])),
                 ("GPU RDMA", f"{sheet['gpu_rdma']} [from sysfs; not verified on RDMA hardware]"),
                 ("config", f"{sheet['config']} (cluster {sheet['cluster']}, model {sheet['model'] or 'none'})"),
                 ("data", data_line),
                 ("tokenizer", tok_line)])]
    return "\n".join(lines)


def format_cluster(sheets: dict[int, dict], pairs: list[dict], settings: DoctorSettings) -> str:
    """The comparison of the nodes and the NIC pair table."""
    rows = [("node", "host", "net", "hetpipe", "torch", "build", "config", "data", "NICs")]
    for node, s in sorted(sheets.items()):
        rows.append((who(s)[len("node "):], s["host"], s["network"], s["hetpipe"], s["torch"], s["build"],
                     s["config"], _data_digest(s["data"]),
                     ",".join(n["name"] or n["address"] for n in s["nics"]) or "-"))
    lines = [f"hetpipe doctor: {len(sheets)} nodes reported", *("  " + r for r in _columns(rows))]
    if pairs:
        lines.append(f"  NIC pairs: TCP connect, then {settings.bandwidth_s:g} s of traffic")
        rows = [("from", "to", "result")]
        for p in pairs:
            result = f"{p['mb_per_s']:.1f} MB/s" if p["ok"] else f"unreachable: {p['error']}"
            rows.append((f"node {p['src']} {p['src_nic']['name']} {p['src_nic']['address']}",
                         f"node {p['dst']} {p['dst_nic']['name']} {p['endpoint'][0]}:{p['endpoint'][1]}", result))
        lines += ["    " + r for r in _columns(rows)]
    return "\n".join(lines)


def torch_lines(sheets: dict[int, dict]) -> list[str]:
    """One line per node with its torch build, and what the doctor makes of it.

    The rule, from evidence: any supported release on any node. Nodes meet only
    through c10d's store and rendezvous, the gloo world group and hetpipe's own
    channels, none of which differs between CUDA and ROCm builds of a release
    (the same code; a ROCm build was not at hand to try). Between releases, CI
    runs two emulated nodes on the range's oldest and newest (either hosting
    the store) and their losses equal a one-process run's on either release
    bit for bit (tests/test_mixed_releases.py). A GPU kernel may differ between
    releases, so mixed releases' GPU losses can differ from one release's in
    the last bits."""
    releases = {torch_release(s["torch"]) for s in sheets.values()}
    lines = []
    for _, sheet in sorted(sheets.items()):
        verdict = "supported" if unsupported_torch(sheet["torch"]) is None else \
            f"not supported (hetpipe supports {range_text()})"
        if len(releases) > 1 and verdict == "supported":
            verdict += "; nodes may run different supported releases"
        lines.append(f"{who(sheet)}: torch {sheet['torch']} ({sheet['build']} build): {verdict}")
    return lines


def _data_digest(data: dict) -> str:
    """One short digest of the data files for the cluster table's "data" column."""
    if not data["files"]:
        return "built-in" if not data["missing"] else "missing"
    joined = "".join(d["sha256"] for _, d in sorted(data["files"].items()))
    return hashlib.sha256(joined.encode()).hexdigest()[:12]


def _differing_data(mine: dict, ref: dict) -> str:
    """Which data files differ (by file name, since paths may differ per node); '' when none do."""
    if mine["missing"] or ref["missing"]:
        return ""  # already a blocker of the node that lacks them
    if not mine["files"] or not ref["files"]:
        return "" if mine["summary"] == ref["summary"] else f"{mine['summary']} vs {ref['summary']}"
    a = {Path(n).suffix: d["sha256"] for n, d in mine["files"].items()}
    b = {Path(n).suffix: d["sha256"] for n, d in ref["files"].items()}
    return ", ".join(f"{suffix} differs" for suffix in sorted(a) if a[suffix] != b.get(suffix))


def _columns(rows: list[tuple]) -> list[str]:
    """Rows as left-aligned columns two spaces apart."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _fields(rows: list[tuple[str, str]]) -> list[str]:
    """Label/value rows of a node's table; a value's further lines hang under its first."""
    out = []
    for label, value in rows:
        first, *rest = value.split("\n")
        out.append(f"  {label:<11}{first}")
        out += [f"  {'':<11}{line}" for line in rest]
    return out

