//! Reading the checkpoint's JSON side files for the special token ids.
//!
//! Owns the rules for EOS and BOS: EOS ids come from `generation_config.json`'s `eos_token_id`
//! when given, else `config.json`'s (top level, or under `text_config` for multimodal configs),
//! else `tokenizer_config.json`'s `eos_token` looked up in the vocabulary. The first id is the
//! primary EOS; the list is de-duplicated in order. BOS comes from `tokenizer_config.json`'s
//! `bos_token`, else `generation_config.json`'s or `config.json`'s `bos_token_id`.
//! A missing file is not an error; a file that cannot be read, is not JSON, or holds a field of the
//! wrong type is, and the message names the file and the field. Costs: one read and parse per file,
//! once per tokenizer.

use crate::error::{CoreError, CoreResult};
use crate::request::TokenId;
use serde_json::Value;
use std::path::Path;

/// Special token ids read from a checkpoint folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SpecialIds {
    pub eos: Vec<TokenId>,
    pub bos: Option<TokenId>,
}

/// One side file's path (for messages) and parsed content.
struct SideFile {
    path: String,
    json: Value,
}

/// Reads the side files in `dir`; `lookup` maps a token string to its id.
pub(crate) fn read_special_ids(
    dir: &Path,
    lookup: impl Fn(&str) -> Option<TokenId>,
) -> CoreResult<SpecialIds> {
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?;
    let gen_cfg = read_json(&dir.join("generation_config.json"))?;
    let model_cfg = read_json(&dir.join("config.json"))?;

    let mut eos = Vec::new();
    if let Some(f) = &gen_cfg {
        eos = id_list(f, &f.json, "eos_token_id")?;
    }
    if eos.is_empty() {
        if let Some(f) = &model_cfg {
            eos = model_config_ids(f, "eos_token_id")?;
        }
    }
    if eos.is_empty() {
        if let Some(f) = &tok_cfg {
            eos.extend(token_string(f, "eos_token")?.and_then(|t| lookup(&t)));
        }
    }
    dedup_in_order(&mut eos);

    let mut bos = None;
    if let Some(f) = &tok_cfg {
        bos = token_string(f, "bos_token")?.and_then(|t| lookup(&t));
    }
    for f in [&gen_cfg, &model_cfg].into_iter().flatten() {
        if bos.is_none() {
            bos = model_config_ids(f, "bos_token_id")?.first().copied();
        }
    }
    Ok(SpecialIds { eos, bos })
}

/// The parsed file, or `None` when it does not exist.
fn read_json(path: &Path) -> CoreResult<Option<SideFile>> {
    let shown = path.display().to_string();
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CoreError::Tokenizer(format!("could not read {shown}: {e}"))),
    };
    let json = serde_json::from_str(&text)
        .map_err(|e| CoreError::Tokenizer(format!("{shown} is not valid JSON: {e}")))?;
    Ok(Some(SideFile { path: shown, json }))
}

/// `key` at the top level of a model config, else under `text_config`.
fn model_config_ids(file: &SideFile, key: &str) -> CoreResult<Vec<TokenId>> {
    let top = id_list(file, &file.json, key)?;
    if !top.is_empty() {
        return Ok(top);
    }
    match file.json.get("text_config") {
        Some(inner) if inner.is_object() => id_list(file, inner, key),
        _ => Ok(Vec::new()),
    }
}

/// `key` as an integer or a list of integers; empty when absent or null.
fn id_list(file: &SideFile, obj: &Value, key: &str) -> CoreResult<Vec<TokenId>> {
    let bad = |given: &Value| {
        CoreError::Tokenizer(format!(
            "{}: `{key}` must be a token id (an integer in 0..2^32) or a list of them. Given: {given}",
            file.path
        ))
    };
    let as_id = |v: &Value| v.as_u64().and_then(|n| TokenId::try_from(n).ok()).ok_or_else(|| bad(v));
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// `key` as a token string, either `"</s>"` or `{"content": "</s>", ...}`.
fn token_string(file: &SideFile, key: &str) -> CoreResult<Option<String>> {
    match file.json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(map)) => match map.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(CoreError::Tokenizer(format!(
                "{}: `{key}` is an object without a string `content`",
                file.path
            ))),
        },
        Some(v) => Err(CoreError::Tokenizer(format!(
            "{}: `{key}` must be a string or an object with `content`. Given: {v}",
            file.path
        ))),
    }
}

fn dedup_in_order(ids: &mut Vec<TokenId>) {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    ids.retain(|id| seen.insert(*id));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support::TempDir;

    fn lookup(t: &str) -> Option<TokenId> {
        match t {
            "</s>" => Some(2),
            "<s>" => Some(1),
            "<|eot|>" => Some(7),
            _ => None,
        }
    }

    #[test]
    fn generation_config_list_wins_and_is_deduplicated() {
        let dir = TempDir::new();
        dir.write("generation_config.json", r#"{"eos_token_id": [7, 2, 7]}"#);
        dir.write("config.json", r#"{"eos_token_id": 5}"#);
        let ids = read_special_ids(dir.path(), lookup).unwrap();
        assert_eq!(ids.eos, vec![7, 2]);
    }

    #[test]
    fn config_json_used_when_generation_config_lacks_eos() {
        let dir = TempDir::new();
        dir.write("generation_config.json", r#"{"bos_token_id": 1}"#);
        dir.write("config.json", r#"{"text_config": {"eos_token_id": [5, 6]}}"#);
        let ids = read_special_ids(dir.path(), lookup).unwrap();
        assert_eq!(ids.eos, vec![5, 6]);
        assert_eq!(ids.bos, Some(1));
    }

    #[test]
    fn tokenizer_config_dict_form_gives_eos_and_bos() {
        let dir = TempDir::new();
        dir.write(
            "tokenizer_config.json",
            r#"{"eos_token": {"content": "</s>", "special": true}, "bos_token": "<s>"}"#,
        );
        let ids = read_special_ids(dir.path(), lookup).unwrap();
        assert_eq!(ids, SpecialIds { eos: vec![2], bos: Some(1) });
    }

    #[test]
    fn no_side_files_means_no_eos() {
        let dir = TempDir::new();
        assert_eq!(read_special_ids(dir.path(), lookup).unwrap(), SpecialIds::default());
    }

    #[test]
    fn wrong_type_names_the_file_and_field() {
        let dir = TempDir::new();
        dir.write("generation_config.json", r#"{"eos_token_id": "two"}"#);
        let err = read_special_ids(dir.path(), lookup).unwrap_err().to_string();
        assert!(err.contains("generation_config.json") && err.contains("eos_token_id"), "{err}");
    }

    #[test]
    fn invalid_json_names_the_file() {
        let dir = TempDir::new();
        dir.write("tokenizer_config.json", "{not json");
        let err = read_special_ids(dir.path(), lookup).unwrap_err().to_string();
        assert!(err.contains("tokenizer_config.json") && err.contains("not valid JSON"), "{err}");
    }
}
