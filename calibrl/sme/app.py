"""The review web app behind ``calibrl sme review`` (Flask, server-rendered pages).

Pages: ``/reviewer`` (a reviewer names themself; kept in a cookie), ``/review`` (the
reviewer's next ungraded item), ``/item/<n>`` (one item and its answer form; keyboard
shortcuts), ``/agreement`` (Cohen's kappa between reviewers and the items they
disagree on), ``/rubric`` (the rubric, its validation records and, with a golden
set, the golden items where judge and experts disagree), ``/healthz``.

Every answer is written to the feedback file before the page moves on
(:class:`~calibrl.sme.store.FeedbackStore`); the page also keeps a draft of the form in
the browser's localStorage on every keystroke, so what an expert typed survives a
dead server or a closed tab until it is saved. With a token, every request must
carry it (``?token=`` once, then a cookie; or ``Authorization: Bearer``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

from calibrl.errors import ConfigError
from calibrl.sme.agreement import pairwise
from calibrl.sme.items import SampleItem, read_items
from calibrl.sme.store import FeedbackStore, check_reviewer
from calibrl.judge_server.authoring.feedback import FeedbackRecord, normalize_tag

REVIEWER_COOKIE = "calibrl_sme_reviewer"
TOKEN_COOKIE = "calibrl_sme_token"
MAX_NOTES_CHARS = 10_000
MAX_TAG_CHARS = 64
MAX_TAGS = 32
TAG_KEYS = "asdghjklzxcv"  # keyboard shortcuts of the rubric's tags, in order (not 1-5, p, f, n, b)


@dataclass
class ReviewSettings:
    """What ``calibrl sme review`` serves."""

    sample: pathlib.Path  # the sample JSONL (calibrl sme sample --out)
    out: pathlib.Path  # the feedback JSONL written (calibrl rubric distill reads it)
    rubric: pathlib.Path | None = None  # rubric YAML: its criteria and error tags are shown
    validation: pathlib.Path | None = None  # validation records (default <rubric>.validation.json)
    golden: pathlib.Path | None = None  # golden JSONL: list its items where judge and experts disagree
    judge: str = "programmatic"  # judge SPEC that scores the golden set for that list
    judge_overrides: list[str] = field(default_factory=list)  # JudgeConfig key=value
    pass_grade: int = 4  # expert pass = grade >= this when no verdict is given
    pass_threshold: float = 0.6  # judge pass = total >= this (golden list)
    token: str = ""  # required on every request when set
    host: str = "127.0.0.1"
    port: int = 8765


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReviewState:
    """Items, rubric and answers of one review server."""

    def __init__(self, settings: ReviewSettings) -> None:
        self.settings = settings
        self.items: list[SampleItem] = read_items(settings.sample)
        self.index = {item.id: i for i, item in enumerate(self.items)}
        self.store = FeedbackStore(settings.out, [item.id for item in self.items])
        self.sample_key = hashlib.sha256(settings.sample.read_bytes()).hexdigest()[:12]
        self.rubric = None
        if settings.rubric is not None:
            from calibrl.judge_server.rubric import load_rubric

            self.rubric = load_rubric(settings.rubric)
        self._golden_rows: list[dict[str, Any]] | None = None
        self._golden_lock = threading.Lock()

    def taxonomy(self) -> list[str]:
        """The rubric's error tags, then every tag a reviewer has used, in first-seen order."""
        tags: list[str] = []
        if self.rubric is not None:
            for criterion in self.rubric.criteria:
                tags += list(criterion.tags)
        for answer in self.store.answers():
            tags += list(answer.record.error_tags)
        return list(dict.fromkeys(tags))

    def next_ungraded(self, reviewer: str, after: int = -1) -> int | None:
        done = self.store.graded_by(reviewer)
        order = list(range(after + 1, len(self.items))) + list(range(0, after + 1))
        return next((i for i in order if self.items[i].id not in done), None)

    def validation_records(self) -> list[Any]:
        from calibrl.judge_server.authoring.validation import read_records, validation_path

        path = self.settings.validation
        if path is None and self.settings.rubric is not None:
            path = validation_path(self.settings.rubric)
        return read_records(path) if path is not None else []

    def golden_disagreements(self) -> list[dict[str, Any]]:
        """Golden items where the judge's pass/fail differs from the experts' (scored once, then kept)."""
        if self.settings.golden is None or self.rubric is None:
            return []
        with self._golden_lock:
            if self._golden_rows is None:
                self._golden_rows = self._score_golden()
            return self._golden_rows

    def _score_golden(self) -> list[dict[str, Any]]:
        from calibrl.config import load_config
        from calibrl.judge_server.config import JudgeConfig
        from calibrl.judge_server.authoring.feedback import read_feedback
        from calibrl.judge_server.judge import Judge, load_llm

        config = load_config(JudgeConfig, None, [*self.settings.judge_overrides, f"backend={self.settings.judge}",
                                                 "allow_unvalidated=true", "cache_size=0"])
        golden = read_feedback(self.settings.golden)
        judge = Judge([self.rubric], config, llm=load_llm(config))
        items = [r.to_item() for r in golden]
        scores = judge.compute(judge.resolve(self.rubric.id), items)
        rows = []
        for record, score in zip(golden, scores):
            expert = record.expert_pass(self.settings.pass_grade)
            judged = score.total >= self.settings.pass_threshold
            if expert != judged:
                rows.append({"record": record, "total": score.total, "expert": "pass" if expert else "fail",
                             "judge": "pass" if judged else "fail",
                             "low": sorted((c.name for c in score.criteria if c.score < 0.5))})
        return rows


def answer_from_form(item: SampleItem, reviewer: str, form: Any) -> tuple[FeedbackRecord | None, dict[str, str]]:
    """The feedback record a submitted form gives, or the problems by field name."""
    problems: dict[str, str] = {}
    grade: int | None = None
    raw_grade = (form.get("grade") or "").strip()
    if raw_grade:
        if raw_grade not in ("1", "2", "3", "4", "5"):
            problems["grade"] = f"grade must be 1-5, got {raw_grade[:20]!r}"
        else:
            grade = int(raw_grade)
    verdict = (form.get("verdict") or "").strip().lower() or None
    if verdict is not None and verdict not in ("pass", "fail"):
        problems["verdict"] = f"verdict must be pass or fail, got {verdict[:20]!r}"
        verdict = None
    if grade is None and verdict is None and not problems:
        problems["grade"] = "give a grade (1-5), a verdict (pass/fail) or both"
    tags = [t for t in form.getlist("tags")]
    tags += [t for t in (form.get("free_tags") or "").split(",") if t.strip()]
    long_tags = [t for t in tags if len(t) > MAX_TAG_CHARS]
    if long_tags:
        problems["free_tags"] = f"a tag may have at most {MAX_TAG_CHARS} characters ({long_tags[0][:20]!r}...)"
    normalized = sorted({normalize_tag(t) for t in tags if normalize_tag(t)})
    if len(normalized) > MAX_TAGS:
        problems["free_tags"] = f"at most {MAX_TAGS} tags per item, got {len(normalized)}"
    notes = (form.get("notes") or "").replace("\r\n", "\n")
    if len(notes) > MAX_NOTES_CHARS:
        problems["notes"] = f"notes may have at most {MAX_NOTES_CHARS} characters, got {len(notes)}"
    if problems:
        return None, problems
    from calibrl.sme.store import feedback_id

    record = FeedbackRecord(
        id=feedback_id(item.id, reviewer), query=item.query, output=item.output, grade=grade, verdict=verdict,
        error_tags=tuple(normalized), retrieved_doc_ids=item.retrieved_doc_ids,
        retrieved_texts=item.retrieved_texts, gold_doc_ids=item.gold_doc_ids, notes=notes.strip(),
        context=item.context,
    )
    return record, {}


def create_app(settings: ReviewSettings) -> Any:
    """The Flask app; raises :class:`ConfigError` for a bad sample, rubric or feedback file."""
    from flask import Flask

    state = ReviewState(settings)
    app = Flask(__name__, template_folder=str(pathlib.Path(__file__).with_name("templates")))
    app.config["MAX_CONTENT_LENGTH"] = 1 << 20  # one answer form is far smaller
    app.extensions["calibrl_sme"] = state
    _add_token_check(app, settings)
    _add_entry_pages(app, state)
    _add_item_page(app, state)
    _add_report_pages(app, state)
    return app


def _current_reviewer() -> str | None:
    """The reviewer of this request (its cookie), None when it has none or a bad one."""
    from flask import request

    name = request.cookies.get(REVIEWER_COOKIE, "")
    try:
        return check_reviewer(name)
    except ConfigError:
        return None


def _common(state: ReviewState) -> dict[str, Any]:
    """What every page shows: the reviewer, their progress and the sample."""
    reviewer = _current_reviewer()
    graded = len(state.store.graded_by(reviewer)) if reviewer else 0
    return {"reviewer": reviewer, "graded": graded, "total": len(state.items), "sample": state.settings.sample.name}


def _add_token_check(app: Any, settings: ReviewSettings) -> None:
    """With ``settings.token``, every page but /healthz needs it (query, cookie or bearer header)."""
    from flask import make_response, redirect, render_template, request

    @app.before_request
    def check_token() -> Any:
        if not settings.token or request.endpoint == "healthz":
            return None
        given = request.args.get("token")
        if given is not None and hmac.compare_digest(given.encode(), settings.token.encode()):
            response = redirect(request.path)
            response.set_cookie(TOKEN_COOKIE, given, httponly=True, samesite="Strict")
            return response
        header = request.headers.get("Authorization", "")
        for candidate in (request.cookies.get(TOKEN_COOKIE, ""), header[7:] if header.startswith("Bearer ") else ""):
            if candidate and hmac.compare_digest(candidate.encode(), settings.token.encode()):
                return None
        return make_response(render_template("message.html", title="Token required",
                                             message="This review server needs its token: open the address "
                                             "printed at start-up (it ends in ?token=...)."), 401)


def _add_entry_pages(app: Any, state: ReviewState) -> None:
    """/healthz, / and the reviewer's name (/reviewer), then the next ungraded item (/review)."""
    from flask import make_response, redirect, render_template, request, url_for

    settings = state.settings

    @app.get("/healthz")
    def healthz() -> Any:
        return {"status": "ok", "items": len(state.items)}

    @app.get("/")
    def home() -> Any:
        return redirect(url_for("review"))

    @app.route("/reviewer", methods=["GET", "POST"])
    def reviewer_page() -> Any:
        target = request.values.get("next") or url_for("review")
        if not target.startswith("/") or target.startswith("//"):
            target = url_for("review")
        error = ""
        if request.method == "POST":
            try:
                name = check_reviewer(request.form.get("name", ""))
            except ConfigError as exc:
                error = str(exc)
            else:
                response = redirect(target)
                response.set_cookie(REVIEWER_COOKIE, name, samesite="Strict", max_age=365 * 24 * 3600)
                return response
        return make_response(render_template("reviewer.html", error=error, target=target,
                                             known=state.store.reviewers(), **_common(state)), 400 if error else 200)

    @app.get("/review")
    def review() -> Any:
        reviewer = _current_reviewer()
        if reviewer is None:
            return redirect(url_for("reviewer_page", next=request.path))
        index = state.next_ungraded(reviewer)
        if index is None:
            return render_template("message.html", title="All done",
                                   message=f"{reviewer} has graded all {len(state.items)} items. Thank you. "
                                   "Answers are in " + str(settings.out) + ".", **_common(state))
        return redirect(url_for("item_page", index=index + 1))


def _add_item_page(app: Any, state: ReviewState) -> None:
    """/item/<n>: one item, its documents and the answer form (a POST saves the answer)."""
    from flask import abort, make_response, redirect, render_template, request, url_for

    settings = state.settings

    @app.route("/item/<int:index>", methods=["GET", "POST"])
    def item_page(index: int) -> Any:
        reviewer = _current_reviewer()
        if reviewer is None:
            return redirect(url_for("reviewer_page", next=request.path))
        if not 1 <= index <= len(state.items):
            abort(404)
        item = state.items[index - 1]
        problems: dict[str, str] = {}
        form: dict[str, Any] | None = None
        if request.method == "POST":
            record, problems = answer_from_form(item, reviewer, request.form)
            if record is not None:
                state.store.save(item.id, reviewer, record)
                following = state.next_ungraded(reviewer, after=index - 1)
                if following is None:
                    return redirect(url_for("review", saved=item.id))
                return redirect(url_for("item_page", index=following + 1, saved=item.id))
            form = {"grade": request.form.get("grade", ""), "verdict": request.form.get("verdict", ""),
                    "tags": request.form.getlist("tags"), "free_tags": request.form.get("free_tags", ""),
                    "notes": request.form.get("notes", "")}
        saved = state.store.answer(item.id, reviewer)
        if form is None:
            taxonomy = set(state.taxonomy())
            form = {"grade": str(saved.grade) if saved and saved.grade else "",
                    "verdict": (saved.verdict or "") if saved else "",
                    "tags": [t for t in saved.error_tags if t in taxonomy] if saved else [],
                    "free_tags": ", ".join(t for t in saved.error_tags if t not in taxonomy) if saved else "",
                    "notes": saved.notes if saved else ""}
        gold = set(item.gold_doc_ids)
        documents = [{"rank": r + 1, "doc_id": doc_id, "gold": doc_id in gold,
                      "text": item.retrieved_texts[r] if r < len(item.retrieved_texts) else ""}
                     for r, doc_id in enumerate(item.retrieved_doc_ids)]
        missed_gold = [d for d in item.gold_doc_ids if d not in set(item.retrieved_doc_ids)]
        taxonomy = state.taxonomy()
        response = make_response(render_template(
            "item.html", item=item, index=index, documents=documents, missed_gold=missed_gold,
            taxonomy=list(zip(taxonomy, list(TAG_KEYS) + [""] * len(taxonomy))), form=form, problems=problems,
            saved=saved is not None, just_saved=request.args.get("saved", ""), rubric=state.rubric,
            draft_key=f"calibrl-sme:{state.sample_key}:{reviewer}:", pass_grade=settings.pass_grade,
            max_notes=MAX_NOTES_CHARS, **_common(state)), 400 if problems else 200)
        return response


def _add_report_pages(app: Any, state: ReviewState) -> None:
    """/agreement (reviewers' pairwise agreement) and /rubric (its validation records)."""
    from flask import render_template

    settings = state.settings

    @app.get("/agreement")
    def agreement_page() -> Any:
        answers = state.store.answers()
        counts: dict[str, int] = {}
        for answer in answers:
            counts[answer.reviewer] = counts.get(answer.reviewer, 0) + 1
        return render_template("agreement.html", pairs=pairwise(answers, settings.pass_grade), counts=counts,
                               index={k: v + 1 for k, v in state.index.items()}, **_common(state))

    @app.get("/rubric")
    def rubric_page() -> Any:
        error = ""
        try:
            records = state.validation_records()
            golden_rows = state.golden_disagreements()
        except ConfigError as exc:
            records, golden_rows, error = [], [], str(exc)
        current = [r for r in records if state.rubric is not None and r.rubric_hash == state.rubric.hash]
        older = [r for r in records if r not in current]
        return render_template("rubric.html", rubric=state.rubric, current=current, older=older,
                               golden_rows=golden_rows, golden=settings.golden, error=error,
                               pass_threshold=settings.pass_threshold, **_common(state))


def serve(settings: ReviewSettings, announce: Any = print) -> None:
    """Serve until SIGINT / SIGTERM; ``announce`` gets the address line (with the token)."""
    import signal

    from werkzeug.serving import make_server

    if not is_loopback(settings.host) and not settings.token:
        raise ConfigError(f"--host {settings.host} is not a loopback address: serving the review page there needs "
                          "--token (or CALIBRL_SME_TOKEN)")
    app = create_app(settings)
    server = make_server(settings.host, settings.port, app, threaded=True)
    port = server.socket.getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{host}:{port}/" + (f"?token={settings.token}" if settings.token else "")
    announce(f"sme review listening on {url}")

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    server.serve_forever()
