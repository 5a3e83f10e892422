"""``kvstore ls``, ``stats``, ``gc`` and ``verify``: the operator's view of what the tiers hold.

The work (listing, choosing, removing, checking) is in :mod:`kvstore.cli.inventory`; this module
turns options into calls and results into tables. Exit codes are in :mod:`kvstore.cli.console`
(and docs/operations.md): 0 done; 1 some objects could not be listed, read or deleted; 2 bad usage or
configuration; 3 ``verify`` found damaged objects and left them in place; 4 the deletion was
not confirmed; 5 a tier's server could not be reached or refused the credentials (one line).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from kvstore.cli.console import (
    EXIT_DAMAGED,
    EXIT_DECLINED,
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    ConfigOption,
    NamespaceOption,
    TierOption,
    console,
    errors,
    load_config,
    make_table,
    parse_duration,
    parse_size,
    progress_bar,
    run,
)
from kvstore.util.lazy import Deferred
from kvstore.util.units import human_age, human_bytes

if TYPE_CHECKING:
    from kvstore.backends import RemoveReport
    from kvstore.cli import inventory
    from kvstore.cli import retention as gc_plans
    from kvstore.config import StoreConfig
else:
    inventory = Deferred("kvstore.cli.inventory")  # the backends, and torch: only when a command runs
    gc_plans = Deferred("kvstore.cli.retention")

# -- helpers ------------------------------------------------------------------------------------


def tier_names(tiers: list[str] | None) -> list[str] | None:
    """The --tier values split on commas (``-t disk,s3`` or ``-t disk -t s3``); None: every enabled tier."""
    names = [name.strip() for value in tiers or [] for name in value.split(",") if name.strip()]
    return names or None


Listing = dict[str, list["inventory.StoredObject"]]
Codecs = dict[str, list[str | None] | None]  # per tier, each listed object's codec; None: headers not read


async def list_all(
    config: StoreConfig, tiers: list[str] | None, namespaces: list[str] | None, codecs: bool | None = False
) -> tuple[dict[str, str], Listing, Codecs, str]:
    """Every selected tier's objects, with a progress line per tier; also each tier's age basis, and what was read.

    ``codecs``: read each object's header for its codec pipeline (one small read per object):
    True everywhere, False nowhere, None where reading leaves the listed ages alone (not Redis,
    whose idle times a read restarts, which would make every chunk look fresh to gc).
    """
    accept = inventory.namespace_filter(namespaces or [])
    listed: Listing = {}
    basis: dict[str, str] = {}
    found: Codecs = {}
    async with inventory.tool_backends(config, tiers) as backends:
        with progress_bar() as bar:
            for name, backend in backends.items():
                task = bar.add_task(f"listing {name}", total=None)
                listed[name] = await inventory.list_objects(backend, accept, lambda n, t=task: bar.advance(t, n))
                basis[name] = backend.age_basis
                found[name] = None
                if codecs or (codecs is None and not backend.reads_refresh_age):
                    task = bar.add_task(f"reading {name} chunk headers", total=len(listed[name]))
                    step = lambda n, t=task: bar.advance(t, n)  # noqa: E731
                    found[name] = await inventory.read_codecs(backend, listed[name], on_read=step)
        where = inventory.sources(backends)
    return basis, listed, found, where


def read_from(where: str, as_json: bool = False) -> None:
    """Say which directory, URL and bucket a command read: above its table, or on stderr beside JSON."""
    (errors if as_json else console).print(f"read from {where}", highlight=False, soft_wrap=True)


def codec_text(codecs: dict[str, int], tier: str, found: Codecs, asked: bool | None = None) -> str:
    """A namespace's codecs for a table cell: ``int4+zstd`` alone, or each with its chunk count.

    ``asked``: ls's --codecs/--no-codecs; unasked, a tier's headers are left unread only where
    reading them restarts the ages gc goes by (Redis), and --codecs reads them.
    """
    if found.get(tier) is None:
        return "(not read)" if asked is False else "(not read: --codecs)"
    if len(codecs) == 1:
        return next(iter(codecs))
    return ", ".join(f"{codec} ({count:,})" for codec, count in codecs.items())


# -- ls and stats -------------------------------------------------------------------------------


def _with_codecs(
    items: list[inventory.StoredObject], codecs: list[str | None] | None
) -> list[tuple[inventory.StoredObject, str | None]]:
    """Each object with its codec (None: not read, or gone since listed)."""
    return list(zip(items, codecs if codecs is not None else [None] * len(items), strict=True))


def ls(
    config: ConfigOption = None,
    tier: TierOption = None,
    namespace: NamespaceOption = None,
    chunks: Annotated[bool, typer.Option("--chunks", help="one row per chunk instead of per namespace")] = False,
    limit: Annotated[int, typer.Option(help="rows to show with --chunks, most recent first (0: all)")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    codecs: Annotated[
        bool | None,
        typer.Option(
            "--codecs/--no-codecs",
            help="read each chunk's header for the codec it is stored with (one small read per chunk). "
            "Default: on disk and S3; not on Redis, where a read restarts the idle time gc goes by",
        ),
    ] = None,
) -> None:
    """What each tier holds, per namespace: chunks, bytes, oldest and newest, codecs (or each chunk with --chunks)."""
    settings = load_config(config)
    basis, listed, found, where = run(lambda: list_all(settings, tier_names(tier), namespace, codecs))
    now = time.time()
    if chunks:
        rows = sorted(
            (
                (name, item, codec_of)
                for name, items in listed.items()
                for item, codec_of in _with_codecs(items, found[name])
            ),
            key=lambda r: -r[1].when,
        )
        rows = rows[:limit] if limit else rows
        if as_json:
            fields = ("namespace", "key", "size", "when")
            document = [{"tier": t, **{f: getattr(i, f) for f in fields}, "codec": c} for t, i, c in rows]
            read_from(where, as_json=True)
            typer.echo(json.dumps(document, indent=1))
            return
        columns = ("tier", "namespace", "key", "bytes", "age", "codec")
        table = make_table(f"chunks, most recent first ({len(rows)} shown)", columns, left=(*columns[:3], "codec"))
        for name, item, codec_of in rows:
            shown = codec_of or ("(gone)" if found[name] is not None else "(not read)")
            table.add_row(name, item.namespace, item.key, human_bytes(item.size), human_age(now - item.when), shown)
        read_from(where)
        console.print(table)
        return
    summaries = [row for name, items in listed.items() for row in inventory.summarize(name, items, now, found[name])]
    if as_json:
        fields = ("tier", "namespace", "chunks", "bytes", "oldest", "newest")
        document = [
            {**{f: getattr(row, f) for f in fields}, "codecs": row.codecs if found[row.tier] is not None else None}
            for row in summaries
        ]
        read_from(where, as_json=True)
        typer.echo(json.dumps(document, indent=1))
        return
    table = make_table(
        "kvstore ls: chunks per tier and namespace",
        ("tier", "namespace", "chunks", "bytes", "oldest", "newest", "age is since", "codecs"),
        left=("tier", "namespace", "age is since", "codecs"),
    )
    for row in summaries:
        table.add_row(
            row.tier,
            row.namespace,
            f"{row.chunks:,}",
            human_bytes(row.bytes),
            human_age(now - row.oldest),
            human_age(now - row.newest),
            basis[row.tier],
            codec_text(row.codecs, row.tier, found, codecs),
        )
    read_from(where)
    console.print(table)
    if not summaries:
        console.print("no chunks stored in the selected tiers and namespaces")


def stats(
    config: ConfigOption = None,
    tier: TierOption = None,
    namespace: NamespaceOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
) -> None:
    """Per tier and namespace: chunks, bytes, average chunk size and an age histogram."""
    settings = load_config(config)
    basis, listed, _, where = run(lambda: list_all(settings, tier_names(tier), namespace))
    now = time.time()
    summaries = [row for name, items in listed.items() for row in inventory.summarize(name, items, now)]
    labels = [label for _, label in inventory.AGE_BUCKETS]
    if as_json:
        document = [
            {
                "tier": row.tier,
                "namespace": row.namespace,
                "chunks": row.chunks,
                "bytes": row.bytes,
                "age_basis": basis[row.tier],
                "ages": dict(zip(labels, row.ages, strict=True)),
            }
            for row in summaries
        ]
        read_from(where, as_json=True)
        typer.echo(json.dumps(document, indent=1))
        return
    table = make_table(
        "kvstore stats: chunks by age (since last write, or last access where the tier records it)",
        ("tier", "namespace", "chunks", "bytes", "avg chunk", *labels),
        left=("tier", "namespace"),
    )
    for name in listed:
        rows = [row for row in summaries if row.tier == name]
        for row in rows:
            average = human_bytes(row.bytes / row.chunks)
            table.add_row(
                row.tier, row.namespace, f"{row.chunks:,}", human_bytes(row.bytes), average, *map(str, row.ages)
            )
        if len(rows) > 1:
            chunks, size = sum(r.chunks for r in rows), sum(r.bytes for r in rows)
            ages = [str(sum(r.ages[i] for r in rows)) for i in range(len(labels))]
            table.add_row(name, "[b]all[/b]", f"{chunks:,}", human_bytes(size), human_bytes(size / chunks), *ages)
    read_from(where)
    console.print(table)


# -- gc -----------------------------------------------------------------------------------------


def gc(
    max_age: Annotated[
        str | None, typer.Option(help="delete chunks not written (or, where recorded, read) for this long: 7d, 12h")
    ] = None,
    max_bytes: Annotated[
        str | None, typer.Option(help="then delete the oldest until each tier holds at most this much: 500GiB")
    ] = None,
    config: ConfigOption = None,
    tier: TierOption = None,
    namespace: NamespaceOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would go, delete nothing")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    install_lifecycle: Annotated[
        bool, typer.Option(help="also set an S3 lifecycle rule expiring objects after --max-age (whole days)")
    ] = False,
) -> None:
    """Delete old chunks from the disk, Redis and S3 tiers: by age, then oldest first down to a byte budget.

    Safe beside running engines: only objects still exactly as listed are deleted (a chunk written
    or read since is kept), and a reader of a deleted chunk sees a miss. Running it again is harmless.
    Temporary files that killed writers left on disk (older than 10 minutes) go too.
    """
    try:
        retention = gc_plans.Retention(
            None if max_age is None else parse_duration(max_age, "--max-age"),
            None if max_bytes is None else parse_size(max_bytes, "--max-bytes"),
        )
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}: pass --max-age and/or --max-bytes") from None
    settings = load_config(config)
    names = tier_names(tier)
    if install_lifecycle:
        check_lifecycle(retention, names, settings)
    code = run(lambda: collect(settings, names, namespace, retention, dry_run, yes, install_lifecycle))
    raise typer.Exit(code)


def check_lifecycle(retention: gc_plans.Retention, names: list[str] | None, settings: StoreConfig) -> None:
    """Refuse --install-lifecycle up front (usage error) unless --max-age is whole days and s3 is selected."""
    if retention.max_age is None or retention.max_age < 86400:
        raise typer.BadParameter("S3 lifecycle rules count whole days: give --max-age of 1d or more")
    if "s3" not in (names or inventory.enabled_tiers(settings)):
        raise typer.BadParameter("--install-lifecycle needs the s3 tier (enable it in the configuration)")


async def collect(
    config: StoreConfig,
    tiers: list[str] | None,
    namespaces: list[str] | None,
    retention: gc_plans.Retention,
    dry_run: bool,
    yes: bool,
    install_lifecycle: bool,
) -> int:
    """List, plan and (unless a dry run or declined) delete; print the plan and the outcome; return the exit code."""
    accept = inventory.namespace_filter(namespaces or [])
    async with inventory.tool_backends(config, tiers) as backends:
        with progress_bar() as bar:
            tasks = {name: bar.add_task(f"listing {name}", total=None) for name in backends}
            plans = await gc_plans.plan_gc(backends, accept, retention, on_page=lambda t, n: bar.advance(tasks[t], n))
        where = inventory.sources(backends)
        doomed = sum(len(plan.victims) for plan in plans)
        doomed_bytes = sum(plan.victim_bytes for plan in plans)
        if dry_run or not doomed:
            read_from(where)
            console.print(gc_table(plans, None, dry_run))
            print_sweep(await inventory.sweep_temporaries(backends, accept, remove=not dry_run))
            if install_lifecycle:
                await lifecycle(backends["s3"], retention, namespaces, dry_run)
            console.print(f"dry run: {doomed:,} chunks ({human_bytes(doomed_bytes)}) would be deleted" if dry_run else
                          "nothing to delete")  # fmt: skip
            return EXIT_OK
        if not yes:
            read_from(where)
            console.print(gc_table(plans, None, dry_run=True))
            if not sys.stdin.isatty():
                errors.print("[red]not deleting without --yes: there is no terminal to ask for confirmation[/red]")
                return EXIT_USAGE
            if not typer.confirm(f"Delete {doomed:,} chunks ({human_bytes(doomed_bytes)})?"):
                console.print("nothing deleted")
                return EXIT_DECLINED
        victims = (item.namespace for plan in plans for item in plan.victims)
        with inventory.removal_events(config, victims) as events, progress_bar() as bar:
            task = bar.add_task("deleting", total=doomed)
            step = lambda _, report: bar.advance(task, report.handled)  # noqa: E731
            reports = await gc_plans.run_gc(backends, plans, step, events)
        read_from(where)
        console.print(gc_table(plans, reports, dry_run=False))
        print_sweep(await inventory.sweep_temporaries(backends, accept, remove=True))
        removed = sum(report.removed for report in reports.values())
        removed_bytes = sum(report.removed_bytes for report in reports.values())
        console.print(f"deleted {removed:,} chunks ({human_bytes(removed_bytes)})")
        if install_lifecycle:
            await lifecycle(backends["s3"], retention, namespaces, dry_run)
    failures = [error for report in reports.values() for error in report.errors]
    for error in failures[:10]:
        errors.print(f"[red]could not delete {error}[/red]", highlight=False)
    return EXIT_ERRORS if failures else EXIT_OK


def print_sweep(sweep: inventory.TemporarySweep | None) -> None:
    """What became of the disk tier's temporary files (nothing is printed when there were none)."""
    if sweep is None:
        return
    from kvstore.backends.temporaries import STALE_TMP_SECONDS

    minutes = f"{STALE_TMP_SECONDS / 60:.0f} min"
    done = "removed" if sweep.removed else "dry run: would remove"
    if sweep.stale:
        console.print(
            f"{done} {sweep.stale:,} stale temporary files ({human_bytes(sweep.stale_bytes)}), "
            f"older than {minutes}: left by writers that were killed"
        )
    if sweep.orphaned:
        console.print(
            f"{done} {sweep.orphaned:,} temporary files ({human_bytes(sweep.orphaned_bytes)}) "
            "of writers that no longer run: left by writers that were killed"
        )
    if sweep.fresh:
        console.print(f"left {sweep.fresh:,} temporary files younger than {minutes}: a writer may still own them")


def gc_table(plans: list[gc_plans.TierPlan], reports: dict[str, RemoveReport] | None, dry_run: bool) -> Table:
    """The plan per tier (what is listed, what goes, what is left) and, after a run, what happened."""
    title = "kvstore gc (dry run: nothing deleted)" if dry_run else "kvstore gc"
    columns = ["tier", "age is since", "listed", "listed bytes", "to delete", "bytes"]
    if reports is not None:
        columns += ["deleted", "changed (kept)", "already gone", "errors"]
    table = make_table(title, [*columns, "left bytes"], left=("tier", "age is since"))
    for plan in plans:
        row = [plan.tier, plan.age_basis, f"{len(plan.listed):,}", human_bytes(plan.listed_bytes)]
        row += [f"{len(plan.victims):,}", human_bytes(plan.victim_bytes)]
        left = plan.listed_bytes - plan.victim_bytes
        if reports is not None:
            report = reports[plan.tier]
            row += [f"{report.removed:,}", f"{report.changed:,}", f"{report.gone:,}", f"{len(report.errors):,}"]
            left = plan.listed_bytes - report.removed_bytes
        table.add_row(*row, human_bytes(left))
    return table


async def lifecycle(backend: Any, retention: gc_plans.Retention, namespaces: list[str] | None, dry_run: bool) -> None:
    """One rule for the whole prefix, or for one namespace when exactly one plain name was given."""
    from kvstore.keys import namespace_dir

    days = math.ceil((retention.max_age or 0) / 86400)
    single = namespaces[0] if namespaces and len(namespaces) == 1 and not re.search(r"[*?\[]", namespaces[0]) else None
    target = None if single is None else namespace_dir(single)
    where = f"s3://{backend.bucket}/{backend.prefix}/" + (f"{target}/" if target else "")
    if dry_run:
        console.print(f"dry run: would set a lifecycle rule expiring {where} after {days} days")
        return
    rule = await backend.install_expiration(days, target)
    console.print(f"lifecycle rule {rule['ID']!r}: objects under {where} expire {days} days after their last write")


# -- verify -------------------------------------------------------------------------------------


def verify(
    config: ConfigOption = None,
    tier: TierOption = None,
    namespace: NamespaceOption = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="remove the damaged objects (only if still as read)")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask before removing")] = False,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="reads in flight per tier")] = 8,
) -> None:
    """Read every chunk and check every checksum; report the damaged ones, and with --delete remove them.

    Temporary files that killed writers left on disk (older than 10 minutes, so no live writer owns
    them) are removed and reported: they are never chunks.

    On Redis before 7.2, reading a value counts as an access: verify restarts the idle times that
    gc's --max-age uses there.
    """
    settings = load_config(config)
    code = run(lambda: check_all(settings, tier_names(tier), namespace, delete, yes, concurrency))
    raise typer.Exit(code)


async def check_all(
    config: StoreConfig,
    tiers: list[str] | None,
    namespaces: list[str] | None,
    delete: bool,
    yes: bool,
    concurrency: int,
) -> int:
    """List and check every selected tier, remove the damaged objects when asked; print them; return the exit code."""
    accept = inventory.namespace_filter(namespaces or [])
    results = []
    async with inventory.tool_backends(config, tiers) as backends:
        sweep = await inventory.sweep_temporaries(backends, accept, remove=True)
        with progress_bar() as bar:
            for name, backend in backends.items():
                listing = bar.add_task(f"listing {name}", total=None)
                objects = await inventory.list_objects(backend, accept, lambda n, t=listing: bar.advance(t, n))
                task = bar.add_task(f"checking {name}", total=len(objects))
                result = await inventory.verify_tier(
                    name, backend, objects, concurrency=concurrency, on_checked=lambda n, t=task: bar.advance(t, n)
                )
                results.append(result)
        damaged = [(result.tier, bad) for result in results for bad in result.damaged]
        for tier_name, bad in damaged:
            console.print(f"damaged: {tier_name} {bad.item.namespace}/{bad.item.key}: {bad.reason}", highlight=False)
        where = inventory.sources(backends)
        if delete and damaged:
            if not yes and not sys.stdin.isatty():
                errors.print("[red]not removing without --yes: there is no terminal to ask for confirmation[/red]")
                print_sweep(sweep)
                return EXIT_USAGE
            if not yes and not typer.confirm(f"Remove {len(damaged)} damaged objects?"):
                console.print("nothing removed")
                print_sweep(sweep)
                return EXIT_DECLINED
            with inventory.removal_events(config, (bad.item.namespace for _, bad in damaged)) as events:
                await inventory.remove_damaged(backends, results, events)
    columns = ("tier", "checked", "bytes", "damaged", "removed", "gone meanwhile", "read errors")
    table = make_table("kvstore verify", columns, left=("tier",))
    for result in results:
        removed = "-" if result.removed is None else f"{result.removed.removed:,}"
        table.add_row(
            result.tier,
            f"{result.checked:,}",
            human_bytes(result.checked_bytes),
            f"{len(result.damaged):,}",
            removed,
            f"{result.gone:,}",
            f"{len(result.errors):,}",
        )
    read_from(where)
    console.print(table)
    print_sweep(sweep)
    for result in results:
        for error in result.errors[:10]:
            errors.print(f"[red]read failed: {result.tier} {error}[/red]", highlight=False)
    if any(result.errors or (result.removed and result.removed.errors) for result in results):
        return EXIT_ERRORS
    # Removed, gone, or rewritten since it was read (an engine healed it): no longer damaged here.
    left = sum(len(r.damaged) - (r.removed.handled - len(r.removed.errors) if r.removed else 0) for r in results)
    return EXIT_DAMAGED if left else EXIT_OK
