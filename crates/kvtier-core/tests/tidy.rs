//! Tidy: checks of the crate's source text that rustc and clippy do not make (after TigerBeetle's
//! `src/tidy.zig`).
//!
//! - **One-way layers.** Each file directly under `src/` and each directory under `src/` is one
//!   module node (`catalog.rs` is `catalog`, everything in `tiers/` is `tiers`); `lib.rs` is the root
//!   that wires them, and `src/bin/` holds separate crates: neither is a node. A `crate::X` path in a
//!   node's code is an edge to node `X`. The edges must not close a cycle: the intended order is
//!   key/format/io -> tiers -> catalog -> mover -> store -> maintenance/service.
//! - **Siblings under `tiers/`.** Each folder and file directly under `src/tiers/` is a tier node
//!   (`tiers/object/sync.rs` is `object`, `tiers/nvme.rs` is `nvme`). A tier node may use another
//!   only if that is the floor, [`TIERS_FLOOR`] (`remote`: what every remote tier shares), and the
//!   floor uses none: the shared-filesystem and object tiers never name each other, so a third
//!   remote tier touches its own folder and not theirs. Paths count as `crate::tiers::X` and as
//!   `super::` paths resolved against the file's place (`super::super::shared` from
//!   `tiers/object/sync.rs` names `shared`).
//! - **Short functions.** No `fn` in `src/` is longer than [`MAX_FUNCTION_LINES`] lines, from its
//!   `fn` line to its closing brace, unless it is on [`LONG_FUNCTIONS`]; an entry there whose
//!   functions all fit again fails too, so that the list only shrinks.
//! - **Short files.** No `.rs` file under `src/` of this crate or of the binding (`kvtier-py`) is
//!   longer than [`MAX_FILE_LINES`] lines, but for [`LONG_FILES`] (issue 38): past that a file has
//!   seams to split along into child modules.
//!
//! Test code is left out of every check: files named `*_tests.rs` (`catalog_model_tests.rs`), and
//! `#[cfg(test)]` items (the `mod tests` blocks), but for a file's length, which counts them (long
//! tests move to a `*_tests.rs` file of their own). The checks read source text, not a syntax tree:
//! comments and the contents of string and char literals are blanked first, so that neither a
//! `crate::` in a doc comment nor a `{` in a format string counts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const MAX_FUNCTION_LINES: usize = 70;

/// The one node under `src/tiers/` that its siblings may use.
const TIERS_FLOOR: &str = "remote";

/// Functions over the limit when this check came (issue 25), as (file under `src/`, name), with
/// their length then. Shorten one, then remove its row; never add one.
const LONG_FUNCTIONS: &[(&str, &str)] = &[];

/// The longest a source file may be.
const MAX_FILE_LINES: usize = 800;

/// Files allowed past [`MAX_FILE_LINES`], as the crate's directory and the path under its `src/`:
/// the option table, one entry per option, is read by looking an option up, not front to back.
const LONG_FILES: &[&str] = &["kvtier-core/config.rs"];

/// One source file: its path under `src/` with `/` separators, and its text.
type Source = (String, String);

#[test]
fn no_cycle_between_modules() {
    let sources = read_sources();
    if let Some(cycle) = find_cycle(&module_graph(&sources)) {
        panic!("module cycle (one-way layers, see this file's header):\n{}", cycle.join("\n"));
    }
}

#[test]
fn tiers_share_only_their_floor() {
    let problems = tiers_problems(&tiers_graph(&read_sources()));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn functions_fit_on_a_screen() {
    let problems = long_function_problems(&read_sources(), LONG_FUNCTIONS);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn files_fit_in_a_reading() {
    let binding = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvtier-py/src");
    let binding_sources = read_tree(&binding);
    assert!(binding_sources.iter().any(|(path, _)| path == "lib.rs"), "{} has no lib.rs", binding.display());
    let core = read_sources().into_iter().map(|(path, text)| (format!("kvtier-core/{path}"), text));
    let all: Vec<Source> =
        core.chain(binding_sources.into_iter().map(|(path, text)| (format!("kvtier-py/{path}"), text))).collect();
    let problems = long_file_problems(&all, LONG_FILES);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every `.rs` file under the crate's `src/`.
fn read_sources() -> Vec<Source> {
    let sources = read_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    // A walker that found nothing would pass every check.
    assert!(sources.iter().any(|(path, _)| path == "lib.rs"), "src/lib.rs not found");
    assert!(sources.len() >= 20, "only {} source files found", sources.len());
    sources
}

/// Every `.rs` file under `root`, by its path under `root`, in path order.
fn read_tree(root: &Path) -> Vec<Source> {
    let mut sources = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(root).unwrap().to_str().unwrap().replace('\\', "/");
                sources.push((relative, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    sources.sort();
    sources
}

fn is_test_file(path: &str) -> bool {
    path.ends_with("_tests.rs")
}

/// The module node a file belongs to; `None` for the root and for the binaries.
fn module_node(path: &str) -> Option<&str> {
    let first = path.split('/').next().unwrap();
    let node = first.strip_suffix(".rs").unwrap_or(first);
    (node != "lib" && node != "bin").then_some(node)
}

/// Node -> node it uses -> where, first seen (`file:line`). Self-edges are left out.
fn module_graph(sources: &[Source]) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (path, text) in sources {
        let Some(node) = module_node(path).filter(|_| !is_test_file(path)) else { continue };
        let edges = graph.entry(node.to_string()).or_default();
        for (target, line) in crate_paths(&without_test_items(&blank_comments_and_literals(text))) {
            if target != node {
                edges.entry(target).or_insert_with(|| format!("src/{path}:{line}"));
            }
        }
    }
    graph
}

/// The first segment of every `crate::` path, with its 1-based line; `crate::{a, b::c}` gives `a`
/// and `b`. `$crate::` (in macros) is the same crate.
fn crate_paths(code: &str) -> Vec<(String, usize)> {
    let firsts = rooted_paths(code, "crate::").into_iter().filter_map(|(_, mut path, line)| {
        let first = path.swap_remove(0);
        (first != "self").then_some((first, line))
    });
    firsts.collect()
}

/// Every path starting with `root` (`crate::` or `super::`), whole: (how many times `root` starts
/// it, its segments after that, its 1-based line). Groups expand: `crate::{a::{X, Y}, b}` gives
/// `[a, X]`, `[a, Y]` and `[b]`; `super::super::x` gives `(2, [x])`. A path ends at anything that
/// is not an identifier, `::` or a group (`crate::a::f(x)` is `[a, f]`).
fn rooted_paths(code: &str, root: &str) -> Vec<(usize, Vec<String>, usize)> {
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find(root).map(|i| i + from) {
        from = at + root.len();
        if at > 0 && (is_ident_byte(bytes[at - 1]) || code[..at].ends_with("::")) {
            continue; // `mycrate::`, or the second `super::` of a chain
        }
        let mut repeats = 1;
        while code[from..].starts_with(root) {
            (repeats, from) = (repeats + 1, from + root.len());
        }
        let line = code[..at].matches('\n').count() + 1;
        let mut paths = Vec::new();
        use_tree(&code[from..], Vec::new(), &mut paths);
        found.extend(paths.into_iter().filter(|p| !p.is_empty()).map(|p| (repeats, p, line)));
    }
    found
}

/// Expands the path (or use tree) that `text` starts with into `out`, each after `prefix`; returns
/// how many bytes it took.
fn use_tree(text: &str, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut at = 0;
    loop {
        at += text[at..].len() - text[at..].trim_start().len();
        if text[at..].starts_with('{') {
            at += 1;
            loop {
                at += use_tree(&text[at..], prefix.clone(), out);
                at += text[at..].len() - text[at..].trim_start().len();
                match text.as_bytes().get(at) {
                    Some(b',') => at += 1,
                    Some(b'}') => return at + 1,
                    _ => return at,
                }
            }
        }
        let ident: String = text[at..].bytes().take_while(|&b| is_ident_byte(b)).map(char::from).collect();
        at += ident.len();
        if !ident.is_empty() {
            prefix.push(ident);
        }
        if !text[at..].starts_with("::") {
            out.push(prefix);
            return at;
        }
        at += 2; // `::`
    }
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The tier node a file under `src/tiers/` belongs to (`tiers/object/sync.rs`: `object`,
/// `tiers/nvme.rs`: `nvme`); `None` for `tiers/mod.rs` and files elsewhere.
fn tiers_node(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("tiers/")?;
    let first = rest.split('/').next().unwrap();
    let node = first.strip_suffix(".rs").unwrap_or(first);
    (node != "mod").then_some(node)
}

/// The module a file is: `tiers/object/sync.rs` is `[tiers, object, sync]`, `tiers/object/mod.rs`
/// `[tiers, object]`.
fn module_path(path: &str) -> Vec<&str> {
    let mut segments: Vec<&str> = path.split('/').collect();
    let last = segments.pop().unwrap().strip_suffix(".rs").unwrap();
    if last != "mod" && last != "lib" {
        segments.push(last);
    }
    segments
}

/// Tier node -> tier node it uses -> where, first seen (`file:line`), over the files under
/// `src/tiers/` (test code left out, as for `module_graph`).
fn tiers_graph(sources: &[Source]) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (path, text) in sources {
        let Some(node) = tiers_node(path).filter(|_| !is_test_file(path)) else { continue };
        let code = without_test_items(&blank_comments_and_literals(text));
        let here = module_path(path);
        let absolute = rooted_paths(&code, "crate::").into_iter().map(|(_, p, line)| (p, line));
        let relative = rooted_paths(&code, "super::").into_iter().filter(|(ups, _, _)| *ups <= here.len()).map(
            |(ups, p, line)| {
                let base = here[..here.len() - ups].iter().map(|s| s.to_string());
                (base.chain(p).collect::<Vec<_>>(), line)
            },
        );
        let edges = graph.entry(node.to_string()).or_default();
        for (target, line) in absolute.chain(relative) {
            if let [first, sibling, ..] = target.as_slice() {
                if first == "tiers" && sibling != node {
                    edges.entry(sibling.clone()).or_insert_with(|| format!("src/{path}:{line}"));
                }
            }
        }
    }
    graph
}

/// Every edge between tier nodes that does not go to the floor.
fn tiers_problems(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<String> {
    let edges = graph.iter().flat_map(|(node, edges)| edges.iter().map(move |(target, at)| (node, target, at)));
    edges
        .filter(|(_, target, _)| target.as_str() != TIERS_FLOOR)
        .map(|(node, target, at)| {
            format!(
                "tiers/{node} uses tiers/{target} ({at}): siblings under tiers/ share only tiers/{TIERS_FLOOR}; move \
                 what both need there"
            )
        })
        .collect()
}

/// A cycle in the graph, as lines `a -> b (where)`, or `None`. Depth-first, in name order, so the
/// same tree always reports the same cycle.
fn find_cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    let mut done = BTreeSet::new();
    for start in graph.keys() {
        let mut path = Vec::new();
        if let Some(cycle) = cycle_from(graph, start, &mut path, &mut done) {
            return Some(cycle);
        }
    }
    None
}

fn cycle_from<'g>(
    graph: &'g BTreeMap<String, BTreeMap<String, String>>,
    node: &'g str,
    path: &mut Vec<&'g str>,
    done: &mut BTreeSet<&'g str>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|&n| n == node) {
        let mut ring: Vec<&str> = path[at..].to_vec();
        ring.push(node);
        let hops = ring.windows(2).map(|w| format!("{} -> {} ({})", w[0], w[1], graph[w[0]][w[1]]));
        return Some(hops.collect());
    }
    if done.contains(node) {
        return None;
    }
    path.push(node);
    for next in graph.get(node).into_iter().flat_map(|edges| edges.keys()) {
        if let Some(cycle) = cycle_from(graph, next, path, done) {
            return Some(cycle);
        }
    }
    path.pop();
    done.insert(node);
    None
}

/// What is wrong with function lengths in `sources` given the `exceptions` list.
fn long_function_problems(sources: &[Source], exceptions: &[(&str, &str)]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut still_long = BTreeSet::new();
    for (path, text) in sources.iter().filter(|(path, _)| !is_test_file(path)) {
        for (name, line, length) in functions(&without_test_items(&blank_comments_and_literals(text))) {
            if length <= MAX_FUNCTION_LINES {
                continue;
            }
            if exceptions.contains(&(path.as_str(), name.as_str())) {
                still_long.insert((path.as_str(), name));
            } else {
                problems.push(format!(
                    "src/{path}:{line}: fn {name} is {length} lines (at most {MAX_FUNCTION_LINES}): split it"
                ));
            }
        }
    }
    for &(path, name) in exceptions {
        if !still_long.contains(&(path, name.to_string())) {
            problems.push(format!(
                "src/{path}: fn {name} is listed in LONG_FUNCTIONS but no longer over \
                 {MAX_FUNCTION_LINES} lines (or gone): remove it from the list"
            ));
        }
    }
    problems
}

/// The files in `sources` (paths `<crate>/<path under src/>`) longer than [`MAX_FILE_LINES`] and not
/// in `exceptions`; test files are left out.
fn long_file_problems(sources: &[Source], exceptions: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    for (path, text) in sources.iter().filter(|(path, _)| !is_test_file(path) && !exceptions.contains(&path.as_str())) {
        let lines = text.lines().count();
        if lines > MAX_FILE_LINES {
            let (krate, file) = path.split_once('/').unwrap_or(("", path));
            problems.push(format!(
                "crates/{krate}/src/{file} is {lines} lines (at most {MAX_FILE_LINES}): split it along its seams \
                 into child modules"
            ));
        }
    }
    problems
}

/// Every function with a body: (name, 1-based line of `fn`, lines from there to its closing brace).
/// Declarations without a body (`fn f();` in a trait) and `fn(..)` pointer types are skipped.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("fn").map(|i| i + from) {
        from = at + 2;
        let word_start = at == 0 || !is_ident_byte(bytes[at - 1]);
        if !word_start || !bytes.get(at + 2).is_some_and(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let rest = code[at + 2..].trim_start();
        let name: String = rest.bytes().take_while(|&b| is_ident_byte(b)).map(char::from).collect();
        if name.is_empty() {
            continue;
        }
        let Some(open) = body_start(bytes, at + 2) else { continue };
        let close = matching_brace(bytes, open).expect("unbalanced braces");
        let line = code[..at].matches('\n').count() + 1;
        let length = code[at..=close].matches('\n').count() + 1;
        found.push((name, line, length));
    }
    found
}

/// The `{` that opens the body of the item starting before `from`: the first `{` outside
/// parentheses and brackets, unless a `;` ends the item first.
fn body_start(bytes: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(from) {
        match b {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth = depth.saturating_sub(1),
            b'{' if depth == 0 => return Some(i),
            b';' if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

fn matching_brace(bytes: &[u8], open: usize) -> Option<usize> {
    assert_eq!(bytes[open], b'{');
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `code` (already blanked) with every `#[cfg(test)]` item blanked: the attribute, any attributes
/// after it, and the item up to its `;` or its matching `}`.
fn without_test_items(code: &str) -> String {
    let mut out = code.as_bytes().to_vec();
    let mut from = 0;
    while let Some(at) = code[from..].find("#[cfg(test)]").map(|i| i + from) {
        let end = match body_start(code.as_bytes(), at + "#[cfg(test)]".len()) {
            Some(open) => matching_brace(code.as_bytes(), open).expect("unbalanced braces"),
            None => code[at..].find(';').map_or(code.len() - 1, |i| i + at),
        };
        blank(&mut out[at..=end]);
        from = end + 1;
    }
    String::from_utf8(out).unwrap()
}

/// Spaces for every byte but newlines, so line numbers stay.
fn blank(bytes: &mut [u8]) {
    for b in bytes.iter_mut().filter(|b| **b != b'\n') {
        *b = b' ';
    }
}

/// `text` with comments and the contents of string and char literals replaced by spaces (the
/// quotes stay; newlines stay, so line numbers do). Lifetimes (`'a`) are left alone. Any byte
/// left that is not ASCII is blanked too, so the result stays valid UTF-8.
fn blank_comments_and_literals(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        let skip_to = match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                bytes[i..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |n| i + n)
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => block_comment_end(bytes, i),
            b'"' => string_end(bytes, i + 1, 0),
            b'r' | b'b' if starts_raw_string(bytes, i) => raw_string_end(bytes, i),
            b'\'' => char_end(bytes, i).unwrap_or(i + 1),
            _ => i + 1,
        };
        if skip_to > i + 1 {
            // Keep the delimiters of a literal visible; blank its inside, or a whole comment.
            let comment = bytes[i] == b'/';
            let (from, to) = if comment { (i, skip_to) } else { (i + 1, skip_to - 1) };
            blank(&mut out[from..to.max(from)]);
        }
        i = skip_to;
    }
    out.iter_mut().filter(|b| !b.is_ascii()).for_each(|b| *b = b' ');
    String::from_utf8(out).unwrap()
}

fn block_comment_end(bytes: &[u8], start: usize) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'/', b'*') => (depth, i) = (depth + 1, i + 2),
            (b'*', b'/') => {
                (depth, i) = (depth - 1, i + 2);
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    bytes.len()
}

/// The index after the closing quote of a string whose contents start at `from`, closed by `"`
/// followed by `hashes` `#`s (escapes only count in a plain string, `hashes == 0`).
fn string_end(bytes: &[u8], from: usize, hashes: usize) -> usize {
    let mut i = from;
    while i < bytes.len() {
        if bytes[i] == b'\\' && hashes == 0 {
            i += 2;
            continue;
        }
        if bytes[i] == b'"' && bytes[i + 1..].iter().take(hashes).filter(|&&b| b == b'#').count() == hashes {
            return i + 1 + hashes;
        }
        i += 1;
    }
    bytes.len()
}

/// `r"`, `r#"`, `br"`, `b"` at `i`, where `i` starts a token (not the `r` of `for"`... or `Err(`).
fn starts_raw_string(bytes: &[u8], i: usize) -> bool {
    if i > 0 && is_ident_byte(bytes[i - 1]) {
        return false;
    }
    let mut j = i + usize::from(bytes[i] == b'b');
    if bytes.get(j) == Some(&b'"') {
        return j > i; // b"..."
    }
    if bytes.get(j) != Some(&b'r') {
        return false;
    }
    j += 1;
    while bytes.get(j) == Some(&b'#') {
        j += 1;
    }
    bytes.get(j) == Some(&b'"')
}

fn raw_string_end(bytes: &[u8], i: usize) -> usize {
    let mut j = i + usize::from(bytes[i] == b'b');
    if bytes[j] == b'"' {
        return string_end(bytes, j + 1, 0); // b"..." has escapes
    }
    j += 1; // the r
    let hashes = bytes[j..].iter().take_while(|&&b| b == b'#').count();
    string_end(bytes, j + hashes + 1, hashes)
}

/// The index after a char literal starting at `i` (`'x'`, `'\n'`, `'\u{1F600}'`, `'é'`), or
/// `None` for a lifetime or label (`'a`, `'static`).
fn char_end(bytes: &[u8], i: usize) -> Option<usize> {
    if bytes.get(i + 1) == Some(&b'\\') {
        // The escaped character may itself be a quote (`'\''`).
        let close = bytes.get(i + 3..)?.iter().position(|&b| b == b'\'')?;
        return Some(i + 3 + close + 1);
    }
    // One character (1 to 4 UTF-8 bytes), then the closing quote.
    let width = match bytes.get(i + 1)? {
        b if *b < 0x80 => 1,
        b if *b >= 0xF0 => 4,
        b if *b >= 0xE0 => 3,
        _ => 2,
    };
    (bytes.get(i + 1 + width) == Some(&b'\'')).then_some(i + 2 + width)
}

/// The checkers themselves, on planted examples rather than the real tree.
mod checker {
    use super::*;

    fn sources(files: &[(&str, &str)]) -> Vec<Source> {
        files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect()
    }

    /// A function `name` of exactly `lines` lines.
    fn function_of(name: &str, lines: usize) -> String {
        assert!(lines >= 2);
        let body: String = (0..lines - 2).map(|i| format!("    let _x{i} = {i};\n")).collect();
        format!("fn {name}() {{\n{body}}}\n")
    }

    #[test]
    fn a_planted_cycle_is_found_and_printed() {
        let files = sources(&[
            ("lib.rs", "mod a; mod b; mod c;\n"),
            ("a.rs", "use crate::b::Thing;\n"),
            ("b/mod.rs", "mod inner;\n"),
            ("b/inner.rs", "fn f() { crate::c::g() }\n"),
            ("c.rs", "use crate::{a::Other, key};\n"),
        ]);
        let cycle = find_cycle(&module_graph(&files)).expect("a -> b -> c -> a is a cycle");
        assert_eq!(
            cycle,
            ["a -> b (src/a.rs:1)", "b -> c (src/b/inner.rs:1)", "c -> a (src/c.rs:1)"],
            "each hop names where it is"
        );
    }

    #[test]
    fn one_way_edges_comments_strings_and_tests_make_no_cycle() {
        let files = sources(&[
            ("a.rs", "use crate::b::Thing;\n"),
            ("b.rs", "// crate::a in a comment\n/// [`crate::a`]\nconst S: &str = \"crate::a\";\n"),
            ("c.rs", "const R: &str = r#\"crate::a \"quoted\" \"#;\nfn f<'a>(x: &'a str) -> char { '\"' }\n"),
            // Test code may use anything: d's tests using b2 would close d -> b2 -> d.
            ("d.rs", "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::b2;\n}\n"),
            ("b2.rs", "use crate::d::x;\n"),
            ("b2_model_tests.rs", "use crate::b2;\n"),
            ("e.rs", "use crate::{a::{X, Y}, b};\n"),
        ]);
        let graph = module_graph(&files);
        assert_eq!(find_cycle(&graph), None, "{graph:?}");
        assert!(graph["b"].is_empty() && graph["c"].is_empty(), "{graph:?}");
        assert_eq!(graph["d"].keys().collect::<Vec<_>>(), ["a"]);
        assert_eq!(graph["e"].keys().collect::<Vec<_>>(), ["a", "b"], "a nested group names its first segment");
        assert!(!graph.contains_key("b2_model_tests"));
    }

    #[test]
    fn paths_expand_groups_and_count_supers() {
        let code =
            "use crate::{tiers::{shared::X, remote}, key};\nfn f() { super::super::a::b(1); crate::c::D::<u8>::e() }\n";
        let crate_found: Vec<_> =
            rooted_paths(code, "crate::").into_iter().map(|(_, p, line)| (p.join("::"), line)).collect();
        let expected = [("tiers::shared::X", 1), ("tiers::remote", 1), ("key", 1), ("c::D", 2)];
        assert_eq!(crate_found, expected.map(|(p, l)| (p.to_string(), l)));
        let supers = rooted_paths(code, "super::");
        assert_eq!(supers, [(2, vec!["a".to_string(), "b".to_string()], 2)], "one chain of two, not two paths");
    }

    #[test]
    fn tier_siblings_may_use_only_the_floor() {
        let files = sources(&[
            ("tiers/mod.rs", "pub mod object; pub mod remote; pub mod shared;\n"),
            ("tiers/remote/mod.rs", "pub mod publisher;\n"),
            ("tiers/remote/publisher.rs", "use crate::tiers::shared::SharedTier;\n"),
            ("tiers/shared/mod.rs", "use crate::tiers::remote::Publisher;\nuse crate::{io, tiers::{remote::X}};\n"),
            ("tiers/shared/sink.rs", "use super::SharedTier;\nuse super::super::remote::Y;\n"),
            ("tiers/object/mod.rs", "use super::shared::ReadOutcome;\nmod access;\n"),
            ("tiers/object/access.rs", "use super::format::X;\nfn f() { super::super::shared::g() }\n"),
            ("tiers/nvme.rs", "use super::dram::Arena;\n#[cfg(test)]\nmod tests { use crate::tiers::object::T; }\n"),
            ("store.rs", "use crate::tiers::{object::BucketTier, shared::SharedTier};\n"),
        ]);
        let graph = tiers_graph(&files);
        assert!(!graph.contains_key("mod") && !graph.contains_key("store"), "{graph:?}");
        assert_eq!(graph["shared"].keys().collect::<Vec<_>>(), ["remote"], "the floor, by path and by super::");
        assert_eq!(graph["object"].keys().collect::<Vec<_>>(), ["shared"], "its own format is no edge");
        assert_eq!(graph["object"]["shared"], "src/tiers/object/mod.rs:1", "first seen, in file order");
        let problems = tiers_problems(&graph);
        let wrong: Vec<&str> = problems.iter().map(|p| p.split(" (").next().unwrap()).collect();
        assert_eq!(
            wrong,
            ["tiers/nvme uses tiers/dram", "tiers/object uses tiers/shared", "tiers/remote uses tiers/shared"]
        );
    }

    #[test]
    fn a_planted_71_line_function_fails_and_70_passes() {
        let text = format!("{}{}", function_of("fits", 70), function_of("too_long", 71));
        let found = functions(&blank_comments_and_literals(&text));
        assert_eq!(found, [("fits".to_string(), 1, 70), ("too_long".to_string(), 71, 71)]);
        let problems = long_function_problems(&sources(&[("m.rs", &text)]), &[]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("src/m.rs:71: fn too_long is 71 lines"), "{problems:?}");
        assert!(long_function_problems(&sources(&[("m.rs", &text)]), &[("m.rs", "too_long")]).is_empty());
    }

    #[test]
    fn a_listed_exception_that_fits_or_is_gone_fails() {
        let text = function_of("shortened", 70);
        let problems = long_function_problems(&sources(&[("m.rs", &text)]), &[("m.rs", "shortened"), ("m.rs", "gone")]);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems.iter().all(|p| p.contains("remove it from the list")), "{problems:?}");
    }

    #[test]
    fn a_planted_801_line_file_fails_and_800_passes_unless_listed_or_tests() {
        let lines = |n: usize| "x\n".repeat(n);
        let files = sources(&[
            ("kvtier-core/fits.rs", &lines(800)),
            ("kvtier-core/tiers/too_long.rs", &lines(801)),
            ("kvtier-py/store.rs", &lines(900)),
            ("kvtier-core/config.rs", &lines(900)),
            ("kvtier-core/catalog_model_tests.rs", &lines(900)),
        ]);
        let problems = long_file_problems(&files, &["kvtier-core/config.rs"]);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("crates/kvtier-core/src/tiers/too_long.rs is 801 lines"), "{problems:?}");
        assert!(problems[1].starts_with("crates/kvtier-py/src/store.rs is 900 lines"), "{problems:?}");
        assert_eq!(
            long_file_problems(
                &files,
                &["kvtier-core/config.rs", "kvtier-core/tiers/too_long.rs", "kvtier-py/store.rs"]
            ),
            Vec::<String>::new()
        );
    }

    #[test]
    fn braces_in_literals_and_comments_do_not_count_and_tests_are_skipped() {
        let text = "fn f() {\n    let s = \"}}}\";\n    let c = '}';\n    // }\n    /* } /* } */ */\n    let r = r#\"}\"#;\n}\n\
                    trait T { fn decl(&self); }\nfn g(cb: fn(u8) -> u8) -> u8 { cb(1) }\n\
                    #[cfg(test)]\nmod tests {\n    fn hidden() {}\n}\n";
        let found = functions(&without_test_items(&blank_comments_and_literals(text)));
        let names: Vec<_> = found.iter().map(|(name, line, length)| (name.as_str(), *line, *length)).collect();
        assert_eq!(names, [("f", 1, 7), ("g", 9, 1)]);
    }
}
