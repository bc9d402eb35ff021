//! The resource presets of Functions (`resourceConfiguration.function.profile`), as Kyma's
//! Serverless configuration sets them: `defaultPreset`, the presets XS to XL (`requestCpu`,
//! `requestMemory`, `limitCpu`, `limitMemory`) and the smallest requests explicit resources may
//! ask for (`minRequestCpu`, `minRequestMemory`). An operator sets them per installation
//! (`--function-presets`, the chart's `controller.functionPresets`); Kyma's values are the
//! defaults. They are one setting of the whole process, like the gateway's domain: read once
//! at start ([`configure`]), then read by every Function's defaults and validation.

use std::{collections::BTreeMap, sync::OnceLock};

use serde::{Deserialize, Serialize};

use super::{FieldError, PROFILES, quantity_value};

/// One preset's requests and limits (Kubernetes quantities).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Preset {
    /// CPU request (`50m`).
    #[serde(deserialize_with = "quantity")]
    pub request_cpu: String,
    /// Memory request (`64Mi`).
    #[serde(deserialize_with = "quantity")]
    pub request_memory: String,
    /// CPU limit.
    #[serde(deserialize_with = "quantity")]
    pub limit_cpu: String,
    /// Memory limit.
    #[serde(deserialize_with = "quantity")]
    pub limit_memory: String,
}

/// A quantity as YAML may write it: text (`100m`) or a bare number (`1`, `0.5`).
fn quantity<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Text(String),
        Number(serde_json::Number),
    }
    Ok(match Written::deserialize(deserializer)? {
        Written::Text(text) => text,
        Written::Number(number) => number.to_string(),
    })
}

/// Every Function preset setting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FunctionPresets {
    /// The preset of a Function that names none (`L`).
    #[serde(default = "default_preset")]
    pub default_preset: String,
    /// The smallest CPU request explicit resources may ask for (`10m`).
    #[serde(
        default = "min_request_cpu",
        alias = "minRequestCPU",
        deserialize_with = "quantity"
    )]
    pub min_request_cpu: String,
    /// The smallest memory request explicit resources may ask for (`16Mi`).
    #[serde(default = "min_request_memory", deserialize_with = "quantity")]
    pub min_request_memory: String,
    /// The presets by name; a name left out keeps Kyma's values.
    #[serde(default)]
    pub presets: BTreeMap<String, Preset>,
}

fn default_preset() -> String {
    super::DEFAULT_PROFILE.to_owned()
}

fn min_request_cpu() -> String {
    "10m".to_owned()
}

fn min_request_memory() -> String {
    "16Mi".to_owned()
}

impl Default for FunctionPresets {
    /// Kyma's values.
    fn default() -> Self {
        Self {
            default_preset: default_preset(),
            min_request_cpu: min_request_cpu(),
            min_request_memory: min_request_memory(),
            presets: kyma_presets(),
        }
    }
}

/// Kyma's presets XS to XL.
fn kyma_presets() -> BTreeMap<String, Preset> {
    PROFILES
        .iter()
        .map(
            |(name, request_cpu, request_memory, limit_cpu, limit_memory)| {
                (
                    (*name).to_owned(),
                    Preset {
                        request_cpu: (*request_cpu).to_owned(),
                        request_memory: (*request_memory).to_owned(),
                        limit_cpu: (*limit_cpu).to_owned(),
                        limit_memory: (*limit_memory).to_owned(),
                    },
                )
            },
        )
        .collect()
}

/// Kyma's configuration around the presets, any of which may hold them: the bare mapping,
/// `function.resources`, or `resourcesConfiguration.function.resources`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wrapped {
    #[serde(default)]
    resources_configuration: Option<FunctionSection>,
    #[serde(default)]
    function: Option<ResourcesSection>,
}

#[derive(Deserialize)]
struct FunctionSection {
    function: ResourcesSection,
}

#[derive(Deserialize)]
struct ResourcesSection {
    resources: FunctionPresets,
}

/// Why a presets file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PresetsError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not YAML (or JSON).
    #[error("not YAML: {0}")]
    Syntax(String),
    /// A field does not fit.
    #[error("{0}")]
    Shape(String),
    /// A field is wrong, named.
    #[error("{}: {}", .0.field, .0.message)]
    Invalid(FieldError),
    /// A problem in the file at `path`.
    #[error("{}: {source}", path.display())]
    In {
        /// The file.
        path: std::path::PathBuf,
        /// The problem.
        #[source]
        source: Box<PresetsError>,
    },
}

impl FunctionPresets {
    /// The presets a YAML (or JSON) text sets, over Kyma's, or what is wrong with it (naming
    /// the field). Pure.
    pub fn parse(text: &str) -> Result<Self, PresetsError> {
        let value: serde_json::Value = serde_yaml_ng::from_str(text)
            .map_err(|error| PresetsError::Syntax(error.to_string()))?;
        let wrapped = value
            .get("resourcesConfiguration")
            .or_else(|| value.get("function"))
            .is_some();
        let mut presets: Self = if wrapped {
            let wrapped: Wrapped = serde_json::from_value(value)
                .map_err(|error| PresetsError::Shape(error.to_string()))?;
            match (wrapped.resources_configuration, wrapped.function) {
                (Some(section), _) => section.function.resources,
                (None, Some(section)) => section.resources,
                (None, None) => Self::default(),
            }
        } else {
            serde_json::from_value(value).map_err(|error| PresetsError::Shape(error.to_string()))?
        };
        for (name, preset) in kyma_presets() {
            presets.presets.entry(name).or_insert(preset);
        }
        presets.check().map_err(PresetsError::Invalid)?;
        Ok(presets)
    }

    /// [`FunctionPresets::parse`] of a file.
    pub fn read(path: &std::path::Path) -> Result<Self, PresetsError> {
        let text = std::fs::read_to_string(path).map_err(|source| PresetsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|problem| PresetsError::In {
            path: path.to_path_buf(),
            source: Box::new(problem),
        })
    }

    /// Whether every name is one of Kyma's five, every quantity one, and the default a preset.
    fn check(&self) -> Result<(), FieldError> {
        for name in self.presets.keys() {
            if !PROFILES.iter().any(|profile| profile.0 == name) {
                return Err(FieldError::new(
                    format!("presets.{name}"),
                    "the presets are XS, S, M, L and XL (Functions name them in \
                     resourceConfiguration.function.profile)",
                ));
            }
        }
        if !self.presets.contains_key(&self.default_preset) {
            return Err(FieldError::new(
                "defaultPreset",
                format!("{:?} is none of XS, S, M, L, XL", self.default_preset),
            ));
        }
        let quantity = |field: String, text: &str| {
            quantity_value(text).map(drop).ok_or_else(|| {
                FieldError::new(
                    field,
                    format!("{text:?} is not a quantity such as 100m or 128Mi"),
                )
            })
        };
        quantity("minRequestCpu".to_owned(), &self.min_request_cpu)?;
        quantity("minRequestMemory".to_owned(), &self.min_request_memory)?;
        for (name, preset) in &self.presets {
            quantity(format!("presets.{name}.requestCpu"), &preset.request_cpu)?;
            quantity(
                format!("presets.{name}.requestMemory"),
                &preset.request_memory,
            )?;
            quantity(format!("presets.{name}.limitCpu"), &preset.limit_cpu)?;
            quantity(format!("presets.{name}.limitMemory"), &preset.limit_memory)?;
        }
        Ok(())
    }

    /// The preset `name`, when it is one.
    pub fn preset(&self, name: &str) -> Option<&Preset> {
        self.presets.get(name)
    }
}

static CONFIGURED: OnceLock<FunctionPresets> = OnceLock::new();

/// Sets this process's presets, once, at start; `Err` with the ones in force when they were set
/// already (to other values).
pub fn configure(presets: FunctionPresets) -> Result<(), Box<FunctionPresets>> {
    match CONFIGURED.set(presets) {
        Ok(()) => Ok(()),
        Err(refused) if CONFIGURED.get() == Some(&refused) => Ok(()),
        Err(_) => Err(Box::new(presets_in_force().clone())),
    }
}

/// This process's presets: the configured ones, else Kyma's.
pub fn presets_in_force() -> &'static FunctionPresets {
    CONFIGURED.get_or_init(FunctionPresets::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kymas_configuration_is_read_in_any_of_its_shapes() {
        let bare = FunctionPresets::parse(
            "defaultPreset: S\nminRequestCpu: 5m\npresets:\n  XS: {requestCpu: 20m, requestMemory: 32Mi, limitCpu: 100m, limitMemory: 128Mi}\n",
        )
        .unwrap();
        assert_eq!(bare.default_preset, "S");
        assert_eq!(bare.min_request_cpu, "5m");
        assert_eq!(bare.min_request_memory, "16Mi");
        assert_eq!(bare.preset("XS").unwrap().request_cpu, "20m");
        // The ones left out keep Kyma's values.
        assert_eq!(bare.preset("L"), FunctionPresets::default().preset("L"));
        let nested = FunctionPresets::parse(
            "resourcesConfiguration:\n  function:\n    resources:\n      minRequestCPU: 20m\n      defaultPreset: M\n",
        )
        .unwrap();
        assert_eq!(nested.default_preset, "M");
        assert_eq!(nested.min_request_cpu, "20m");
        assert_eq!(
            FunctionPresets::parse("{}").unwrap(),
            FunctionPresets::default()
        );
        // Numbers are quantities too, as Kubernetes reads them.
        let whole = FunctionPresets::parse(
            "presets: {XL: {requestCpu: 1, requestMemory: 1Gi, limitCpu: 2.5, limitMemory: 2Gi}}",
        )
        .unwrap();
        assert_eq!(whole.preset("XL").unwrap().request_cpu, "1");
        assert_eq!(whole.preset("XL").unwrap().limit_cpu, "2.5");
    }

    #[test]
    fn bad_presets_are_refused_naming_the_field() {
        for (text, field) in [
            ("defaultPreset: XXL\n", "defaultPreset"),
            (
                "presets: {XXL: {requestCpu: 1, requestMemory: 1Gi, limitCpu: 2, limitMemory: 2Gi}}",
                "presets.XXL",
            ),
            (
                "presets: {S: {requestCpu: lots, requestMemory: 1Gi, limitCpu: 2, limitMemory: 2Gi}}",
                "presets.S.requestCpu",
            ),
            ("minRequestMemory: much\n", "minRequestMemory"),
            ("surprise: 1\n", "surprise"),
        ] {
            let problem = FunctionPresets::parse(text).unwrap_err().to_string();
            assert!(problem.contains(field), "{text}: {problem}");
        }
    }
}
