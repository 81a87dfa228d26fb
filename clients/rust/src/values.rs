//! Values as every caller reads them (rule V1): a computed value is returned as the server
//! stores it, so that the computing caller and the waiting ones get the same.

use serde_json::Value;

/// `value` as every other caller reads it from the server (V1): jsonb keeps numbers as
/// `numeric`, which writes a float given with an exponent in plain digits, so that
/// `1.2345678901234567e19` reads back as the integer `12345678901234567000`.
pub(crate) fn as_stored(value: Value) -> Value {
    match value {
        Value::Number(n) if n.is_f64() => {
            let text = n.to_string();
            match text.split_once(['e', 'E']) {
                Some((mantissa, exponent)) => {
                    let plain = plain_decimal(mantissa, exponent.parse().unwrap_or(0));
                    serde_json::from_str(&plain).unwrap_or(Value::Number(n))
                }
                None => Value::Number(n),
            }
        }
        Value::Array(items) => Value::Array(items.into_iter().map(as_stored).collect()),
        Value::Object(members) => Value::Object(
            members
                .into_iter()
                .map(|(k, v)| (k, as_stored(v)))
                .collect(),
        ),
        other => other,
    }
}

/// `mantissa` times ten to `exponent`, in plain digits, as PostgreSQL's numeric writes it.
fn plain_decimal(mantissa: &str, exponent: i32) -> String {
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let point = int.len() as i32 + exponent; // where the decimal point goes in `digits`
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}", "0".repeat(point as usize - digits.len()))
    } else {
        format!(
            "{}.{}",
            &digits[..point as usize],
            &digits[point as usize..]
        )
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::as_stored;
    use serde_json::json;

    #[test]
    fn numbers_read_back_as_jsonb_writes_them() {
        assert_eq!(
            as_stored(json!(1.2345678901234567e19)),
            json!(12345678901234567000u64)
        );
        assert_eq!(
            as_stored(json!([1e-7, 2.5, 1.0, -3e2])),
            json!([0.0000001, 2.5, 1.0, -300.0])
        );
    }
}
