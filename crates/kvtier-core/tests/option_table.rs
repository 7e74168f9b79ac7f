//! The option table (`config::OPTIONS`): each setter sets exactly the field its getter reads, values of
//! the wrong kind and unknown names are refused naming the option, and defaults come from
//! `StoreConfig::new` / `SharedConfig::new`.

use kvtier_core::SharedConfig;
use kvtier_core::{find_option, ConfigOption, Error, OptionKind, OptionValue, StoreConfig, OPTIONS};
use std::collections::HashSet;
use std::path::PathBuf;

/// A value of the option's kind that differs from its default.
fn other_value(option: &ConfigOption) -> OptionValue {
    let default = option.default_value();
    match option.kind {
        OptionKind::Int => OptionValue::Int(match default {
            Some(OptionValue::Int(v)) => v + 1,
            _ => 7,
        }),
        OptionKind::Size => OptionValue::Int(match default {
            Some(OptionValue::Int(v)) => v + 4096,
            _ => 1 << 20,
        }),
        OptionKind::Float => OptionValue::Float(if default == Some(OptionValue::Float(0.5)) { 0.25 } else { 0.5 }),
        OptionKind::Bool => OptionValue::Bool(!matches!(default, Some(OptionValue::Bool(true)))),
        OptionKind::Path => OptionValue::Path(PathBuf::from("/some/root")),
        OptionKind::BytesOrStr => OptionValue::Bytes(b"another namespace".to_vec()),
        OptionKind::Choice(choices) => {
            let v = choices.iter().rev().find(|c| default != Some(OptionValue::Str(c.to_string()))).unwrap();
            OptionValue::Str(v.to_string())
        }
    }
}

fn snapshot(config: &StoreConfig) -> Vec<(&'static str, Option<OptionValue>)> {
    OPTIONS.iter().map(|o| (o.name, o.value(config))).collect()
}

#[test]
fn names_are_unique_and_python_names_follow_the_fields() {
    let mut names = HashSet::new();
    for o in OPTIONS {
        assert!(names.insert(o.name), "{} listed twice", o.name);
        assert!(!o.description.is_empty(), "{} has no description", o.name);
        assert_eq!(o.name.starts_with("shared_"), o.field.starts_with("shared."), "{}", o.name);
        assert!(find_option(o.name).is_some());
    }
    // Removed with the publisher's wait: must not come back.
    assert!(find_option("shared_publish_wait_ms").is_none());
}

#[test]
fn each_setter_sets_exactly_the_field_its_getter_reads() {
    for option in OPTIONS {
        let mut config = ConfigOption::default_config();
        let before = snapshot(&config);
        let value = other_value(option);
        config.set_option(option.name, value.clone()).unwrap();
        assert_eq!(
            option.value(&config),
            Some(value.clone()),
            "{}: getter does not read what the setter set",
            option.name
        );
        for ((name, old), (_, new)) in before.iter().zip(snapshot(&config)) {
            // A shared_* option creates the shared-tier configuration, whose root is then empty.
            // Likewise a bucket_* option creates the object tier's, whose URL is then empty.
            if *name == option.name
                || (*name == "shared_root" && option.name.starts_with("shared_"))
                || (*name == "bucket_url" && option.name.starts_with("bucket_"))
            {
                continue;
            }
            assert_eq!(old, &new, "setting {} changed {name}", option.name);
        }
        if option.name.starts_with("shared_") {
            assert!(config.shared.is_some(), "{} did not create the shared-tier configuration", option.name);
        }
        // Setting the default back restores the default.
        if let Some(default) = option.default_value() {
            config.set_option(option.name, default.clone()).unwrap();
            assert_eq!(option.value(&config), Some(default), "{}", option.name);
        }
    }
}

#[test]
fn defaults_are_read_from_the_constructors() {
    let store = StoreConfig::new("/x", 4096);
    let shared = SharedConfig::new("/s");
    let text = |name: &str| find_option(name).unwrap().default_text();
    assert_eq!(find_option("dram_bytes").unwrap().default_value(), Some(OptionValue::Int(store.dram_bytes as u64)));
    assert_eq!(find_option("io_depth").unwrap().default_value(), Some(OptionValue::Int(store.io_depth as u64)));
    assert_eq!(
        find_option("shared_publish_queue_bytes").unwrap().default_value(),
        Some(OptionValue::Int(shared.publish_queue_bytes as u64))
    );
    assert_eq!(
        find_option("shared_high_watermark").unwrap().default_value(),
        Some(OptionValue::Float(shared.high_watermark))
    );
    assert_eq!(text("object_bytes"), "required");
    assert_eq!(text("shared_root"), find_option("shared_root").unwrap().unset);
    assert_eq!(
        text("shared_publish_queue_bytes"),
        format!("{} MiB", shared.publish_queue_bytes >> 20),
        "sizes render in binary units"
    );
}

#[test]
fn wrong_kinds_bad_choices_and_unknown_names_are_refused() {
    let mut config = ConfigOption::default_config();
    for (name, value) in [
        ("dram_bytes", OptionValue::Float(1.0)),
        ("shared_fail_on_full", OptionValue::Int(1)),
        ("io_engine", OptionValue::Str("spdk".into())),
        ("namespace", OptionValue::Str("not bytes".into())),
    ] {
        match config.set_option(name, value) {
            Err(Error::Config { option, message }) => {
                assert_eq!(option, name);
                assert!(message.contains("expected"), "{message}");
            }
            other => panic!("{name}: expected a config error, got {other:?}"),
        }
    }
    match config.set_option("dram_byte", OptionValue::Int(1)) {
        Err(e @ Error::Config { .. }) => {
            let message = e.to_string();
            assert!(message.contains("dram_byte") && message.contains("`dram_bytes`"), "{message}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn validation_errors_name_options_of_the_table() {
    // Each rule of validate names an option a user can find in the table (or `path`).
    type Break = Box<dyn Fn(&mut StoreConfig)>;
    let cases: Vec<(&str, Break)> = vec![
        ("staging_slots", Box::new(|c| c.staging_slots = 1)),
        ("io_depth", Box::new(|c| c.io_depth = 0)),
        ("load_threads", Box::new(|c| c.load_threads = 0)),
        ("store_queue_jobs", Box::new(|c| c.store_queue_jobs = 0)),
        ("max_write_inflight_bytes", Box::new(|c| c.max_write_inflight_bytes = 0)),
        ("shared_high_watermark", Box::new(|c| c.shared.as_mut().unwrap().high_watermark = 1.5)),
        ("shared_publish_queue_bytes", Box::new(|c| c.shared.as_mut().unwrap().publish_queue_bytes = 1)),
        ("shared_grace_ms", Box::new(|c| c.shared.as_mut().unwrap().grace_ms = 1)),
    ];
    for (name, break_it) in cases {
        let mut config = StoreConfig::new("/tmp/x", 4096);
        config.namespace = b"m".to_vec();
        config.nvme_bytes = 0;
        config.shared = Some(SharedConfig::new("/tmp/s"));
        config.validate().unwrap();
        break_it(&mut config);
        match config.validate() {
            Err(Error::Config { option, .. }) => {
                assert_eq!(option, name);
                assert!(find_option(option).is_some(), "{option} is not in the option table");
            }
            other => panic!("{name}: expected a config error, got {other:?}"),
        }
    }
}
