//! `#[derive(OpTable)]`: the `Op` enum of nestor-ir is the op table. Each variant is one
//! declaration (its name, its fields with their docs), and this derive writes what every
//! op needs from it: `name`, `operands`, `map_operands`, `attrs` and `from_parts` (the
//! parser's half of the text form).
//!
//! A field's role comes from its type through `nestor_ir`'s `OpField` trait: `ValueId`,
//! `Option<ValueId>` and `Vec<ValueId>` are operands (one, an optional trailing one, all
//! the rest), every other type is an attribute of the text form named like the field.
//! The `#[op(...)]` attribute says the rest:
//!
//! | where | attribute | meaning |
//! |---|---|---|
//! | variant | `name = "linear"` | the op's name in the text form |
//! | variant | `family = Gemm` | its `OpFamily`: the module of each stage that handles it |
//! | variant | `custom` | operands and attributes written by hand (`Op::custom_*`) |
//! | field | `kind` | the op's name is this field's word (`OpKind`), as for `unary` ops |
//! | field | `names("softmax", "log_softmax")` | a bool field naming the op: false, then true |
//! | field | `only_if = "path"` | the attribute exists only where `path(kind)` holds |

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use quote::{format_ident, quote};
use syn::{parse_macro_input, Data, DeriveInput, Error, Fields, Ident, LitStr, Path, Type};

/// Writes `name`, `family`, `operands`, `map_operands_in_place`, `attrs` and `from_parts` for an op
/// enum whose variants carry `#[op(...)]` attributes (see the crate docs).
#[proc_macro_derive(OpTable, attributes(op))]
pub fn derive_op_table(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

/// How a variant's name is found.
enum Naming {
    /// A fixed word.
    Fixed(LitStr),
    /// The word of a field of an `OpKind` type.
    Kind(usize),
    /// A bool field: its name when false, then when true.
    Bool(usize, LitStr, LitStr),
}

/// One field of a variant.
struct FieldSpec {
    ident: Ident,
    ty: Type,
    only_if: Option<Path>,
}

/// One variant of the op enum.
struct VariantSpec {
    ident: Ident,
    naming: Naming,
    family: Ident,
    custom: bool,
    fields: Vec<FieldSpec>,
}

impl VariantSpec {
    /// The index of the field that names the op, if one does.
    fn kind_field(&self) -> Option<usize> {
        match self.naming {
            Naming::Fixed(_) => None,
            Naming::Kind(index) | Naming::Bool(index, ..) => Some(index),
        }
    }

    /// `Self::Variant { a: field_0, b: field_1, .. }` binding every field but the kind.
    fn pattern(&self, with_kind: bool) -> Tokens {
        let ident = &self.ident;
        let bindings = self.fields.iter().enumerate().filter_map(|(index, field)| {
            let name = &field.ident;
            let local = local(index);
            (with_kind || Some(index) != self.kind_field()).then(|| quote!(#name: #local))
        });
        quote!(Self::#ident { #(#bindings,)* .. })
    }

    /// The indices of the fields that are not the kind.
    fn plain_fields(&self) -> impl Iterator<Item = (usize, &FieldSpec)> {
        let kind = self.kind_field();
        self.fields
            .iter()
            .enumerate()
            .filter(move |(index, _)| Some(*index) != kind)
    }
}

fn local(index: usize) -> Ident {
    format_ident!("field_{}", index)
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Enum(data) = &input.data else {
        return Err(Error::new_spanned(input, "OpTable derives for enums only"));
    };
    let variants = data
        .variants
        .iter()
        .map(variant_spec)
        .collect::<syn::Result<Vec<_>>>()?;
    let enum_ident = &input.ident;
    let name_arms = variants.iter().map(name_arm);
    let family_arms = variants.iter().map(|variant| {
        let (ident, family) = (&variant.ident, &variant.family);
        quote!(Self::#ident { .. } => crate::OpFamily::#family,)
    });
    let operand_arms = variants.iter().map(operands_arm);
    let map_arms = variants.iter().map(map_arm);
    let attr_arms = variants.iter().map(attrs_arm);
    let parsers = variants.iter().map(parser);
    let idents: Vec<&Ident> = variants.iter().map(|variant| &variant.ident).collect();
    Ok(quote! {
        impl #enum_ident {
            /// Every variant's name as written in Rust, in declaration order (an op
            /// named by a field, as `Unary`, is one variant).
            pub const VARIANTS: &'static [&'static str] = &[#(stringify!(#idents)),*];

            /// The name of this op's variant (one of [`Self::VARIANTS`]).
            pub fn variant(&self) -> &'static str {
                match self { #(Self::#idents { .. } => stringify!(#idents),)* }
            }

            /// The op's name in the text form.
            pub fn name(&self) -> &'static str {
                match self { #(#name_arms)* }
            }

            /// The op's family: the module of each stage (type inference, interpreter,
            /// lowering) that handles it.
            pub fn family(&self) -> crate::OpFamily {
                match self { #(#family_arms)* }
            }

            /// The values the op reads, in order (optional operands only when present).
            pub fn operands(&self) -> Vec<crate::ValueId> {
                let mut out = Vec::new();
                match self { #(#operand_arms)* }
                out
            }

            /// Maps every operand in place, in the order of [`Self::operands`].
            fn map_operands_in_place(&mut self, f: &mut dyn FnMut(crate::ValueId) -> crate::ValueId) {
                match self { #(#map_arms)* }
            }

            /// The op's attributes for the text form, in a fixed order.
            pub fn attrs(&self) -> Vec<(&'static str, crate::Attr)> {
                let mut out = Vec::new();
                match self { #(#attr_arms)* }
                out
            }

            /// Rebuilds an op from its text-form parts: name, operands, attributes and,
            /// for `per_element`, its body. The inverse of [`name`](Self::name),
            /// [`operands`](Self::operands) and [`attrs`](Self::attrs).
            pub fn from_parts(
                op_name: &str,
                operands: &[crate::ValueId],
                attrs: &[(String, crate::Attr)],
                body: Option<crate::Graph>,
            ) -> Result<Self, String> {
                let mut parts = crate::op::Parts::new(op_name, operands, attrs, body);
                #(#parsers)*
                Err(format!("unknown op {op_name}"))
            }
        }
    })
}

fn variant_spec(variant: &syn::Variant) -> syn::Result<VariantSpec> {
    let mut name = None;
    let mut family = None;
    let mut custom = false;
    for attr in variant
        .attrs
        .iter()
        .filter(|attr| attr.path().is_ident("op"))
    {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("name") {
                name = Some(meta.value()?.parse::<LitStr>()?);
                Ok(())
            } else if meta.path.is_ident("family") {
                family = Some(meta.value()?.parse::<Ident>()?);
                Ok(())
            } else if meta.path.is_ident("custom") {
                custom = true;
                Ok(())
            } else {
                Err(meta.error("expected `name = \"...\"`, `family = ...` or `custom`"))
            }
        })?;
    }
    let Fields::Named(named) = &variant.fields else {
        return Err(Error::new_spanned(variant, "op variants have named fields"));
    };
    let mut fields = Vec::new();
    let mut naming = name.map(Naming::Fixed);
    for (index, field) in named.named.iter().enumerate() {
        let mut only_if = None;
        for attr in field.attrs.iter().filter(|attr| attr.path().is_ident("op")) {
            attr.parse_nested_meta(|meta| {
                let mut set_naming = |found: Naming| {
                    if naming.is_some() {
                        return Err(meta.error("the op is named twice"));
                    }
                    naming = Some(found);
                    Ok(())
                };
                if meta.path.is_ident("kind") {
                    set_naming(Naming::Kind(index))
                } else if meta.path.is_ident("names") {
                    let content;
                    syn::parenthesized!(content in meta.input);
                    let when_false: LitStr = content.parse()?;
                    content.parse::<syn::Token![,]>()?;
                    let when_true: LitStr = content.parse()?;
                    set_naming(Naming::Bool(index, when_false, when_true))
                } else if meta.path.is_ident("only_if") {
                    only_if = Some(meta.value()?.parse::<LitStr>()?.parse::<Path>()?);
                    Ok(())
                } else {
                    Err(meta.error("expected `kind`, `names(..)` or `only_if = \"...\"`"))
                }
            })?;
        }
        let ident = field
            .ident
            .clone()
            .ok_or_else(|| Error::new_spanned(field, "op fields are named"))?;
        fields.push(FieldSpec {
            ident,
            ty: field.ty.clone(),
            only_if,
        });
    }
    let naming = naming.ok_or_else(|| {
        Error::new_spanned(
            &variant.ident,
            "an op needs `#[op(name = \"...\")]` or a field marked `kind` or `names(..)`",
        )
    })?;
    let family = family
        .ok_or_else(|| Error::new_spanned(&variant.ident, "an op needs `#[op(family = ...)]`"))?;
    let spec = VariantSpec {
        ident: variant.ident.clone(),
        naming,
        family,
        custom,
        fields,
    };
    if spec.fields.iter().any(|field| field.only_if.is_some()) && spec.kind_field().is_none() {
        return Err(Error::new_spanned(
            &variant.ident,
            "`only_if` tests the op's kind: the op needs a `kind` field",
        ));
    }
    Ok(spec)
}

fn name_arm(variant: &VariantSpec) -> Tokens {
    let ident = &variant.ident;
    match &variant.naming {
        Naming::Fixed(word) => quote!(Self::#ident { .. } => #word,),
        Naming::Kind(index) => {
            let field = &variant.fields[*index].ident;
            quote!(Self::#ident { #field: kind, .. } => crate::op::OpKind::op_name(*kind),)
        }
        Naming::Bool(index, when_false, when_true) => {
            let field = &variant.fields[*index].ident;
            quote!(Self::#ident { #field: kind, .. } => if *kind { #when_true } else { #when_false },)
        }
    }
}

fn operands_arm(variant: &VariantSpec) -> Tokens {
    let ident = &variant.ident;
    if variant.custom {
        return quote!(Self::#ident { .. } => out = self.custom_operands(),);
    }
    let pattern = variant.pattern(false);
    let pushes = variant.plain_fields().map(|(index, field)| {
        let (ty, local) = (&field.ty, local(index));
        quote!(<#ty as crate::op::OpField>::push_operands(#local, &mut out);)
    });
    quote!(#pattern => { #(#pushes)* })
}

fn map_arm(variant: &VariantSpec) -> Tokens {
    let ident = &variant.ident;
    if variant.custom {
        return quote!(Self::#ident { .. } => self.custom_map_operands(f),);
    }
    let pattern = variant.pattern(false);
    let maps = variant.plain_fields().map(|(index, field)| {
        let (ty, local) = (&field.ty, local(index));
        quote!(<#ty as crate::op::OpField>::map_operands(#local, f);)
    });
    quote!(#pattern => { #(#maps)* })
}

fn attrs_arm(variant: &VariantSpec) -> Tokens {
    let ident = &variant.ident;
    if variant.custom {
        return quote!(Self::#ident { .. } => out = self.custom_attrs(),);
    }
    let pattern = variant.pattern(true);
    let kind = variant.kind_field().map(local);
    let pushes = variant.plain_fields().map(|(index, field)| {
        let (ty, local) = (&field.ty, local(index));
        let key = LitStr::new(&field.ident.to_string(), Span::call_site());
        let push = quote! {
            if let Some(attr) = <#ty as crate::op::OpField>::to_attr(#local) {
                out.push((#key, attr));
            }
        };
        match (&field.only_if, &kind) {
            (Some(condition), Some(kind)) => quote!(if #condition(*#kind) { #push }),
            _ => push,
        }
    });
    quote!(#[allow(unused_variables)] #pattern => { #(#pushes)* })
}

fn parser(variant: &VariantSpec) -> Tokens {
    let ident = &variant.ident;
    let test = match &variant.naming {
        Naming::Fixed(word) => quote!(op_name == #word),
        Naming::Kind(index) => {
            let ty = &variant.fields[*index].ty;
            let local = local(*index);
            quote!(let Some(#local) = <#ty as crate::op::OpKind>::from_op_name(op_name))
        }
        Naming::Bool(_, when_false, when_true) => {
            quote!(op_name == #when_false || op_name == #when_true)
        }
    };
    if variant.custom {
        return quote!(if #test { return Self::custom_from_parts(&mut parts); });
    }
    let bool_kind = match &variant.naming {
        Naming::Bool(index, _, when_true) => {
            let local = local(*index);
            Some(quote!(let #local = op_name == #when_true;))
        }
        _ => None,
    };
    let kind = variant.kind_field().map(local);
    let arities = variant.plain_fields().map(|(_, field)| {
        let ty = &field.ty;
        quote!(<#ty as crate::op::OpField>::ARITY)
    });
    let reads = variant.plain_fields().map(|(index, field)| {
        let (ty, local) = (&field.ty, local(index));
        let key = LitStr::new(&field.ident.to_string(), Span::call_site());
        let read = quote!(<#ty as crate::op::OpField>::parse(#key, &mut parts)?);
        match (&field.only_if, &kind) {
            (Some(condition), Some(kind)) => {
                quote!(let #local = if #condition(#kind) { #read } else { Default::default() };)
            }
            _ => quote!(let #local = #read;),
        }
    });
    let fields = variant.fields.iter().enumerate().map(|(index, field)| {
        let (name, local) = (&field.ident, local(index));
        quote!(#name: #local)
    });
    quote! {
        if #test {
            #bool_kind
            parts.check_arity(&[#(#arities),*])?;
            #(#reads)*
            return Ok(Self::#ident { #(#fields),* });
        }
    }
}
